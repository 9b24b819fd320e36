"""EngineConfig: every knob of the engine, frozen and validated at construction.

Runtime facts (the number of KV blocks actually allocated, the EOS ids, the resolved device)
are computed once by the executor and passed on; they are never written back here.

EngineAccess: who may call a `fairgate engine` server (its keys). They share the `engine`
section of fairgate.yaml but are no knobs: never in EngineConfig, so never in /admin/config,
best.yaml, a tune report or a launch command line.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.vllm_flags import KEY_ALIASES
from protocol.validators import (
    check_bool,
    check_choice,
    check_int,
    check_known_keys,
    check_number,
    check_positive_int,
    from_mapping,
)

POLICIES = ("fcfs", "priority", "sjf", "prefix", "fair")
PREEMPTION_MODES = ("recompute", "swap")
EXECUTORS = ("torch", "sim")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "int8")
DTYPES = ("auto", "float32", "float16", "bfloat16")
SIM_CLOCKS = ("virtual", "realtime")
SIM_HARDWARE = ("h100", "h200", "a100", "l4", "a10g", "cpu")
METRICS_COMPAT = ("vllm",)  # other engines whose metric names /metrics can also export


@dataclass(frozen=True)
class EngineConfig:
    # what to run
    model: str = "random:tiny"
    # the names the API serves the model under (vLLM's served_model_name), one or a list: the
    # first is the id in /v1/models, in responses and in the metrics' model_name label; unset:
    # `model` itself. `model` stays accepted in requests as an alias (served_model_names).
    served_model_name: str | Sequence[str] | None = None
    executor: str = "torch"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    # step budgets
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # prompt + output tokens per request; None: the model's own context length (config.json's
    # max_position_embeddings, the random:<preset>'s or the sim_model's), set by the engine
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0  # 0: no per-request cap on a prefill chunk
    max_num_partial_prefills: int = 1
    # memory
    block_size: int = 16
    memory_fraction: float = 0.9
    num_kv_blocks: int | None = None  # override of the profiled block count
    device_memory_gb: float | None = None  # CPU: memory the engine may treat as its device
    kv_cache_dtype: str = "auto"
    swap_space_gb: float = 1.0
    enable_prefix_caching: bool = True
    # order and preemption
    policy: str = "fcfs"
    preemption: str = "recompute"
    sjf_aging_tokens_per_s: float = 1000.0  # sjf: a request's estimated work shrinks this fast while it waits
    # fair: a tenant this much weighted service (VTC cost / weight, protocol.fairness) ahead of
    # the least-served active tenant is far ahead (its new prefills are held back, see
    # FairShareQueue.far_ahead_tenants); its own knob so the token budget can be tuned alone
    fair_far_ahead_tokens: int = 2048
    # model execution
    attention_backend: str = "auto"
    # simulated executor
    sim_hardware: str = "h100"
    sim_model: str = "llama-3-8b"
    sim_clock: str = "virtual"
    # a `fairgate tune calibrate` profile (engine/sim_profile.py): step times and KV capacity
    # fitted to a real engine instead of sim_hardware's roofline
    sim_profile: str | None = None
    # engine-side admission (server)
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 4_000_000
    # "vllm": /metrics (the engine server's, or the gateway's for its embedded engine) also
    # exports every engine series under vLLM's name, so vLLM's dashboards work unchanged;
    # None: fairgate_engine_* only (half the series)
    metrics_compat: str | None = None

    def __post_init__(self) -> None:
        if self.served_model_name is not None:  # one form, a tuple, whatever YAML gave
            object.__setattr__(self, "served_model_name", _served_names(self.served_model_name))
        for name, choices in _CHOICES.items():
            check_choice(name, getattr(self, name), choices)
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size",
                     "max_num_partial_prefills", "max_waiting_requests", "max_waiting_tokens",
                     "fair_far_ahead_tokens"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, low=0)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        check_int("seed", self.seed)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_number("swap_space_gb", self.swap_space_gb, low=0)
        check_number("sjf_aging_tokens_per_s", self.sjf_aging_tokens_per_s, low=0)
        if self.device_memory_gb is not None:
            check_number("device_memory_gb", self.device_memory_gb, low=0, open_low=True)
        check_number("memory_fraction", self.memory_fraction, low=0, high=1, open_low=True)
        if self.sim_profile is not None:
            _check_sim_profile(self.sim_profile)
        if self.metrics_compat is not None:
            try:
                check_choice("metrics_compat", self.metrics_compat, METRICS_COMPAT)
            except ValueError as error:
                raise ValueError(f"{error} (or null: fairgate's names only)") from None
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token per step; raise "
                "max_num_batched_tokens or lower max_num_seqs")
        # the checks that involve max_model_len wait until it is known (see with_context_length)
        max_model_len = self.max_model_len
        kv_tokens = None if self.num_kv_blocks is None else self.num_kv_blocks * self.block_size
        if max_model_len is not None and kv_tokens is not None and kv_tokens < max_model_len:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) x block_size ({self.block_size}) holds "
                f"{kv_tokens} tokens, fewer than max_model_len ({max_model_len}): one full-length "
                "request could never run; raise num_kv_blocks or lower max_model_len")
        if self.preemption == "swap" and self.swap_space_gb == 0:
            raise ValueError("preemption='swap' needs swap_space_gb > 0 (host memory for swapped "
                             "blocks); set swap_space_gb or use preemption='recompute'")
        if max_model_len is not None and self.max_waiting_tokens < max_model_len:
            raise ValueError(
                f"max_waiting_tokens ({self.max_waiting_tokens}) must be >= max_model_len "
                f"({max_model_len}): a full-length request could never be queued")
        if self.long_prefill_token_threshold > self.max_num_batched_tokens:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names the API serves the model under; the first is its id (vLLM's rule)."""
        return tuple(self.served_model_name or ()) or (self.model,)

    @property
    def accepted_model_names(self) -> tuple[str, ...]:
        """The names a request may give: the served names, and `model` as an alias."""
        return tuple(dict.fromkeys((*self.served_model_names, self.model)))

    @property
    def context_source(self) -> str:
        """Where the model's context length comes from, for messages."""
        if self.executor == "sim":
            if self.sim_profile is not None:
                return f"sim_profile {self.sim_profile}"
            return f"sim_model {self.sim_model}"
        if self.model.startswith("random:"):
            return f"the {self.model} preset"
        return "max_position_embeddings in config.json"

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len of a config the engine runs on (LLMEngine.config and the configs it
        gives its scheduler and executor), where it is always set."""
        if self.max_model_len is None:
            raise RuntimeError("max_model_len is unset: only the engine's own config "
                               "(LLMEngine.config, via with_context_length) has it resolved")
        return self.max_model_len

    def with_context_length(self, context_length: int) -> EngineConfig:
        """This config for a model whose context is `context_length` tokens: max_model_len set
        to it when unset, else checked against it (vLLM's rule)."""
        source = f"{context_length}, {self.context_source}"
        if self.max_model_len is None:
            try:
                return self.replace(max_model_len=context_length)
            except ValueError as error:
                raise ValueError(f"{error} (max_model_len is unset, so it is the model's context "
                                 f"length: {source})") from None
        if self.max_model_len > context_length:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's "
                             f"context length ({source}); lower max_model_len")
        return self

    def replace(self, **changes: Any) -> EngineConfig:
        """A new validated config with some knobs changed (unknown knobs: ValueError); vLLM's
        names for fairgate's knobs are taken too (canonical_knobs)."""
        changes = canonical_knobs(changes)
        check_known_keys("engine", changes, KNOBS)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> EngineConfig:
        """Build from a YAML/JSON mapping; unknown keys are an error naming the key. The
        server's keys in the same section (ACCESS_KEYS) are EngineAccess's, left out here."""
        if isinstance(values, Mapping):
            values = canonical_knobs({k: v for k, v in values.items() if k not in ACCESS_KEYS})
        return from_mapping(cls, values, "engine")

    def to_dict(self) -> dict[str, Any]:
        """The knobs as JSON and YAML write them (the served names as a list)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.served_model_name is not None:
            values["served_model_name"] = list(self.served_model_name)
        return values


def canonical_knobs(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with vLLM's names for fairgate's knobs (KEY_ALIASES: gpu_memory_utilization is
    memory_fraction, swap_space swap_space_gb, num_gpu_blocks_override num_kv_blocks) under the
    knobs' own names; ValueError when both names of one knob are given."""
    out = dict(values)
    for alias, knob in KEY_ALIASES.items():
        if alias in out:
            if knob in out:
                raise ValueError(f"engine: {alias} is vLLM's name for {knob}; give one of them, "
                                 "not both")
            out[knob] = out.pop(alias)
    return out


def _served_names(value: object) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if (not isinstance(names, (list, tuple)) or not names
            or not all(isinstance(n, str) and n.strip() == n and n for n in names)):
        raise ValueError("served_model_name must be a name or a list of names (non-empty, "
                         f"without surrounding spaces), got {value!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"served_model_name lists a name twice: {value!r}")
    return tuple(names)


def _check_sim_profile(path: object) -> None:
    from engine.sim_profile import load_profile  # reads YAML: only configs that name a profile

    if not isinstance(path, str) or not path:
        raise ValueError(f"sim_profile must be the path of a calibration profile, got {path!r}")
    try:
        load_profile(path)
    except ValueError as error:
        raise ValueError(f"sim_profile: {error}; write one with `fairgate tune calibrate "
                         "--out FILE`") from None


KNOBS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_CHOICES = {"policy": POLICIES, "preemption": PREEMPTION_MODES, "executor": EXECUTORS,
            "attention_backend": ATTENTION_BACKENDS, "kv_cache_dtype": KV_CACHE_DTYPES,
            "dtype": DTYPES, "sim_clock": SIM_CLOCKS, "sim_hardware": SIM_HARDWARE}



# ---- who may call the engine's server -------------------------------------------------------
# The keys from the environment (a Kubernetes Secret, compose's .env): `fairgate engine` takes
# them over the file; the gateway sends them to backends without keys of their own, and
# `fairgate tune` to the engine it replays on.
ENGINE_KEY_ENV = "FAIRGATE_ENGINE_KEY"
ENGINE_ADMIN_KEY_ENV = "FAIRGATE_ENGINE_ADMIN_KEY"
MIN_KEY_CHARS = 16
_HEADER_SAFE = re.compile(r"[!-~]+")  # visible ASCII: it is sent in an HTTP header


def check_header_key(name: str, value: object) -> str:
    """A key sent as `Authorization: Bearer <key>` to some server: visible ASCII."""
    if not isinstance(value, str) or not _HEADER_SAFE.fullmatch(value):
        raise ValueError(f"{name} must be visible ASCII characters, no spaces (it is sent in "
                         "an HTTP header)")
    return value


def check_bearer_key(name: str, value: object) -> str:
    """A key a fairgate engine accepts: at least 16 visible ASCII characters."""
    check_header_key(name, value)
    assert isinstance(value, str)
    if len(value) < MIN_KEY_CHARS:
        raise ValueError(f"{name} must be at least {MIN_KEY_CHARS} characters")
    return value


def environment_keys(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """($FAIRGATE_ENGINE_KEY, $FAIRGATE_ENGINE_ADMIN_KEY), each None when unset or empty."""
    def key(name: str) -> str | None:
        value = environ.get(name)
        return check_bearer_key(name, value) if value else None

    return key(ENGINE_KEY_ENV), key(ENGINE_ADMIN_KEY_ENV)


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only: localhost, 127.0.0.0/8, ::1."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name other than localhost, or "" (every address)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class EngineAccess:
    """The keys of a `fairgate engine` server. `api_key`: `/v1/*`, `/load` and `/stats`;
    `admin_key`: `/admin/*` (None: the api_key). None for both: every route is open, which
    only a loopback address allows unless `allow_unauthenticated` says so."""

    api_key: str | None = None
    admin_key: str | None = None
    allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        for name in ("api_key", "admin_key"):
            if getattr(self, name) is not None:
                check_bearer_key(f"engine.{name}", getattr(self, name))
        check_bool("engine.allow_unauthenticated", self.allow_unauthenticated)

    @property
    def effective_admin_key(self) -> str | None:
        """The key /admin/* asks for."""
        return self.admin_key if self.admin_key is not None else self.api_key

    def with_environment(self, environ: Mapping[str, str]) -> EngineAccess:
        """$FAIRGATE_ENGINE_KEY and $FAIRGATE_ENGINE_ADMIN_KEY, when set and not empty, over
        the file's keys (the keys can then live in a Secret and the file in a ConfigMap)."""
        api_key, admin_key = environment_keys(environ)
        return dataclasses.replace(self, api_key=api_key or self.api_key,
                                   admin_key=admin_key or self.admin_key)

    def check_host(self, host: str) -> None:
        """ValueError (one line) when serving on `host` would let anyone who reaches it
        generate and reconfigure: a non-loopback address without an api_key, unless
        allow_unauthenticated."""
        if self.api_key is None and not self.allow_unauthenticated and not is_loopback(host):
            raise ValueError(
                f"--host {host or '(every address)'} is reachable from other machines and no "
                f"api key is set: set engine.api_key (or ${ENGINE_KEY_ENV}, or --api-key), "
                "or pass --allow-unauthenticated (engine.allow_unauthenticated: true) to serve "
                "it open on purpose")

    @classmethod
    def from_section(cls, values: Mapping[str, Any] | None) -> EngineAccess:
        """The access keys of an `engine` section (its knobs are EngineConfig's)."""
        if not isinstance(values, Mapping):
            return cls()
        return cls(**{k: v for k, v in values.items() if k in ACCESS_KEYS})


ACCESS_KEYS = tuple(f.name for f in dataclasses.fields(EngineAccess))
