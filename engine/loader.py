"""Load a model: a local Hugging Face checkpoint folder, or `random:<preset>` random weights.

Weights are never held twice: the module is built on the meta device, materialised with empty
tensors on the target device, then each checkpoint tensor is read alone (safetensors `safe_open`)
and copied into its parameter (or its slice of a fused parameter).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model import PACKED_WEIGHTS, LlamaForCausalLM, packed_shard_rows
from engine.model_config import ModelConfig
from engine.presets import model_preset
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

logger = logging.getLogger("fairgate.engine")

# checkpoint tensors that are not weights of this model (old Llama checkpoints store inv_freq)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]


def load_model(name: str, ops: Any, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> LoadedModel:
    """`name`: a checkpoint folder or `random:<preset>`."""
    if name.startswith("random:"):
        return load_random(name.removeprefix("random:"), ops, device, dtype, seed)
    return load_checkpoint(Path(name), ops, device, dtype)


def build_empty(config: ModelConfig, ops: Any, device: torch.device,
                dtype: torch.dtype) -> LlamaForCausalLM:
    """The module with uninitialised parameters on `device` (no init pass, no second copy)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives every parameter its own storage
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# random:<preset>


def load_random(preset: str, ops: Any, device: torch.device, dtype: torch.dtype,
                seed: int) -> LoadedModel:
    config = model_preset(preset)
    model = build_empty(config, ops, device, dtype)
    init_random_weights(model, seed)
    tokenizer = ByteTokenizer(vocab_size=config.vocab_size)
    return LoadedModel(model, config, tokenizer, tokenizer.eos_token_ids)


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Deterministic weights (same seed, same model on any device): filled per tensor on the CPU
    from one generator, so a large preset never needs a second full copy."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        values = torch.randn(param.shape, generator=generator) * 0.02
        if name.endswith("embed_tokens.weight"):
            values *= 50  # O(1) embeddings, as trained models have, so logits are not flat
        param.copy_(values)


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoint folder


def load_checkpoint(folder: Path, ops: Any, device: torch.device,
                    dtype: torch.dtype) -> LoadedModel:
    if not folder.is_dir():
        raise ValueError(f"model {str(folder)!r} is neither a checkpoint folder nor random:<preset> "
                         "(presets: random:tiny, random:small, random:llama-3-8b, ...)")
    hf_config = read_json(folder / "config.json")
    config = ModelConfig.from_hf(hf_config, str(folder / "config.json"))
    window = hf_config.get("sliding_window")
    mistral = config.architecture == "MistralForCausalLM"
    if window and (mistral or hf_config.get("use_sliding_window")):
        logger.warning("%s: sliding-window attention (%d tokens) is not implemented; attention "
                       "spans the whole context, exact for sequences up to %d tokens",
                       folder, window, window)
    model = build_empty(config, ops, device, dtype)
    load_weights(model, folder)
    tokenizer = HFTokenizer.from_folder(folder)
    return LoadedModel(model, config, tokenizer, read_eos_ids(folder, tokenizer))


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_eos_ids(folder: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (int or list), else config.json's, else the
    tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        eos = read_json(path).get("eos_token_id") if path.is_file() else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return tokenizer.eos_token_ids


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weight files (PyTorch .bin checkpoints are "
                         "not supported; convert them with safetensors)")
    return files


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Copy every checkpoint tensor into its (slice of a) parameter; every parameter row must be
    written exactly by the checkpoint, else the error names what is missing."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    filled: dict[str, int] = dict.fromkeys(params, 0)  # rows written so far
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = _target(model.config, name, params, path)
                if target is not None:
                    param_name, start, rows = target
                    _copy(params[param_name], start, rows, f.get_tensor(name), path, name)
                    filled[param_name] += rows
    _check_all_filled(params, filled, folder)


def _target(config: ModelConfig, name: str, params: dict[str, torch.Tensor],
            path: Path) -> tuple[str, int, int] | None:
    """(parameter name, first row, rows) that checkpoint tensor `name` fills, or None to skip."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # tied: the embedding is the head
    module, _, kind = name.rpartition(".")  # kind: weight | bias
    parent, _, leaf = module.rpartition(".")
    if leaf in PACKED_WEIGHTS:
        fused, shard = PACKED_WEIGHTS[leaf]
        start, rows = packed_shard_rows(config, fused, shard)
        return _known(f"{parent}.{fused}.{kind}", params, path, name), start, rows
    param_name = _known(name, params, path, name)
    return param_name, 0, params[param_name].shape[0]


def _known(param_name: str, params: dict[str, torch.Tensor], path: Path, name: str) -> str:
    if param_name not in params:
        raise ValueError(f"{path}: tensor {name!r} does not belong to a "
                         f"{len(params)}-parameter model of this config (unexpected weight; "
                         "is config.json from another model?)")
    return param_name


def _copy(param: torch.Tensor, start: int, rows: int, tensor: torch.Tensor, path: Path,
          name: str) -> None:
    expected = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                         f"{expected} from config.json")
    param[start:start + rows].copy_(tensor)


def _check_all_filled(params: dict[str, torch.Tensor], filled: dict[str, int],
                      folder: Path) -> None:
    missing = [name for name, param in params.items() if filled[name] != param.shape[0]]
    if missing:
        shown = ", ".join(_hf_name(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{folder}: missing weights in the *.safetensors files: {shown}{more}")


def _hf_name(param_name: str) -> str:
    """Checkpoint name(s) of a parameter, for messages."""
    module, _, kind = param_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    parts = [hf for hf, (fused, _) in PACKED_WEIGHTS.items() if fused == leaf]
    if parts:
        return "/".join(f"{parent}.{hf}.{kind}" for hf in parts)
    return param_name
