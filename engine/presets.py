"""Model shapes by name: `random:<preset>` checkpoints and the simulated executor's cost model."""

from __future__ import annotations

from engine.model_config import ModelConfig

_LLAMA3_ROPE_THETA = 500000.0

MODEL_PRESETS: dict[str, ModelConfig] = {
    # a few million parameters: CPU tests and the default demo
    "tiny": ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=64, max_position=4096,
                        rope_theta=_LLAMA3_ROPE_THETA, tie_word_embeddings=True),
    "small": ModelConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, max_position=8192,
                         rope_theta=_LLAMA3_ROPE_THETA),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                              max_position=131072, rope_theta=_LLAMA3_ROPE_THETA),
    "llama-3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                               max_position=131072, rope_theta=_LLAMA3_ROPE_THETA),
}


def model_preset(name: str) -> ModelConfig:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets are: "
                         f"{', '.join(MODEL_PRESETS)}") from None
