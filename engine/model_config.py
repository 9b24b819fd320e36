"""A model's shape and architecture: one dataclass for a Hugging Face `config.json`, a
`random:<preset>` (engine.presets) and the simulated executor's cost model. No torch here: the
simulated executor and the tuner read shapes without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections (Qwen2: always)
    mlp_bias: bool = False
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face `config.json` mapping; unsupported models fail naming `source`."""
        architecture = _architecture(hf, source)
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            config = cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
                max_position=int(hf.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(hf),
                rope_scaling=_rope_scaling(hf, source),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                architecture=architecture,
            )
        except KeyError as missing:
            raise ValueError(f"{source}: missing required field {missing}") from None
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({config.num_kv_heads})")
        return config

    @property
    def num_params(self) -> int:
        """Weights, biases left out (the simulated executor's cost model reads this)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _architecture(hf: dict[str, Any], source: str) -> str:
    names = hf.get("architectures") or []
    if not names:
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM"}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
        raise ValueError(f"{source}: no 'architectures' entry (and model_type "
                         f"{hf.get('model_type')!r} is unknown); supported: {', '.join(ARCHITECTURES)}")
    if names[0] not in ARCHITECTURES:
        raise ValueError(f"{source}: architecture {names[0]!r} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return str(names[0])


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: dict[str, Any], source: str) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_scaling` (type or rope_type)
    scaling = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    return {"rope_type": rope_type, **scaling} if rope_type != "default" else {}
