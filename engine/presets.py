"""Model shapes by name: `random:<preset>` checkpoints and the simulated executor's cost model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position: int = 8192
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


MODEL_PRESETS: dict[str, ModelShape] = {
    # a few million parameters: CPU tests and the default demo
    "tiny": ModelShape(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4,
                       num_heads=4, num_kv_heads=2, max_position=4096, tie_word_embeddings=True),
    "small": ModelShape(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=8,
                        num_heads=8, num_kv_heads=4, max_position=8192),
    "llama-3-8b": ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, max_position=131072),
    "llama-3-70b": ModelShape(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, max_position=131072),
}


def model_preset(name: str) -> ModelShape:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets are: "
                         f"{', '.join(MODEL_PRESETS)}") from None
