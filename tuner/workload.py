"""Workloads: what requests to send and when, as a sorted list of `TraceRequest`.

A workload is synthetic (lengths drawn from a distribution, arrivals from a process) or a trace
replay (lengths and arrivals from a file, see `tuner.traces`). `build_requests` turns a workload
plus a `LoadShape` (rate, duration, arrivals, speed, slicing) and `Limits` (token scaling and caps)
into requests. `build_mix` does the same for several tenants, each with its own workload, key,
priority class and share of the rate.

Named workloads (`WORKLOADS`): fixed, uniform, longtail, shared-prefix, azure-conv, azure-code,
mooncake. A workload file (YAML or JSON, `load_workload_file`) describes a tenant mix::

    rate: 20                 # total requests/s (optional; --rate wins)
    duration: 60             # seconds (optional; --duration wins)
    arrivals: poisson        # poisson | gamma | constant | trace
    burstiness: 1.0          # gamma shape: 1 = Poisson, < 1 burstier
    model: llama-3-8b        # the model every request names (optional; --model wins)
    tenants:
      - {tenant: acme, api_key: fg-acme, priority: interactive, share: 0.8, workload: longtail}
      - tenant: batchco
        priority: batch
        rate: 2                # a fixed rate instead of a share
        workload: {kind: uniform, prompt_tokens: [128, 1024], output_tokens: [32, 256]}

An inline workload is ``{kind: fixed|uniform|longtail|shared-prefix, ...}`` with the fields of
`Synthetic` / `Lengths`, or ``{trace: PATH, format: auto}``; ``{base: NAME, ...}`` overrides fields
of a named synthetic workload.

Prompt text comes from a `TokensToText` function: `byte_tokens_to_text` (the default; fairgate's
byte-level tokenizer: one token per UTF-8 byte plus BOS) or `word_tokens_to_text` (about one token
per common English word in BPE vocabularies).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from protocol.validators import (
    check_choice,
    check_int,
    check_known_keys,
    check_number,
    check_positive_int,
    from_mapping,
)
from tuner.traces import BLOCK_TOKENS, TraceRequest, load_trace

ARRIVALS = ("poisson", "gamma", "constant", "trace")
LENGTH_DISTS = ("fixed", "uniform", "lognormal")


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution. `tail_prob` adds rare `tail_tokens`-long outliers."""

    dist: str = "fixed"  # fixed | uniform | lognormal
    value: int = 128  # fixed value, or the lognormal median
    low: int = 1
    high: int = 1024
    sigma: float = 1.0
    tail_prob: float = 0.0
    tail_tokens: int = 30_000

    def __post_init__(self) -> None:
        check_choice("dist", self.dist, LENGTH_DISTS)
        for name in ("value", "low", "high", "tail_tokens"):
            check_positive_int(name, getattr(self, name))
        check_number("sigma", self.sigma, low=0)
        check_number("tail_prob", self.tail_prob, 0.0, 1.0)
        if self.low > self.high:
            raise ValueError(f"lengths need low ({self.low}) <= high ({self.high})")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            out = np.full(n, self.value, dtype=np.int64)
        elif self.dist == "uniform":
            out = rng.integers(self.low, self.high + 1, size=n)
        else:
            out = np.clip(
                np.rint(rng.lognormal(math.log(self.value), self.sigma, n)), self.low, self.high
            ).astype(np.int64)
        if self.tail_prob > 0:
            out = np.where(rng.random(n) < self.tail_prob, self.tail_tokens, out)
        return out

    @classmethod
    def parse(cls, spec: Any) -> Lengths:
        """`128` (fixed), `[lo, hi]` (uniform) or a dict of fields."""
        if isinstance(spec, Lengths):
            return spec
        if isinstance(spec, int):
            return cls("fixed", value=spec, low=1, high=max(1, spec))
        if isinstance(spec, list | tuple) and len(spec) == 2:
            return cls("uniform", low=int(spec[0]), high=int(spec[1]))
        if isinstance(spec, dict):
            return from_mapping(cls, spec, "lengths")
        raise ValueError(f"lengths must be an int, [low, high] or a mapping, got {spec!r}")


@dataclass(frozen=True)
class Synthetic:
    """Lengths from distributions; `prefix_groups` > 0 gives every request one of that many
    shared `prefix_tokens`-long prompt prefixes (system prompts, few-shot examples)."""

    name: str
    prompt_tokens: Lengths
    output_tokens: Lengths
    prefix_groups: int = 0
    prefix_tokens: int = 0
    default_rate: float = 10.0

    def __post_init__(self) -> None:
        check_int("prefix_groups", self.prefix_groups, low=0)
        check_int("prefix_tokens", self.prefix_tokens, low=0)
        check_number("default_rate", self.default_rate, low=0, open_low=True)


@dataclass(frozen=True)
class TraceReplay:
    name: str
    path: Path
    format: str = "auto"


Workload = Synthetic | TraceReplay


@dataclass(frozen=True)
class LoadShape:
    """When requests arrive. `rate` None = the workload's own (a trace's timestamps, or a
    synthetic workload's default rate); `speed` replays a trace k times faster; `start` slices
    a trace from that many trace-seconds in, and `window` to that many trace-seconds from
    there (then `rate` is the mean over the window: its requests over its length);
    `arrivals="trace"` keeps a trace's timestamps."""

    rate: float | None = None
    duration: float | None = 60.0
    num_requests: int | None = None
    arrivals: str | None = None  # None = trace for replays, poisson for synthetic
    burstiness: float = 1.0
    speed: float = 1.0
    start: float = 0.0
    seed: int = 0
    window: float | None = None

    def __post_init__(self) -> None:
        if self.arrivals is not None:
            check_choice("arrivals", self.arrivals, ARRIVALS)
        if self.rate is not None and self.rate != math.inf:  # inf: everything at once
            check_number("rate", self.rate, low=0, open_low=True)
        check_number("burstiness", self.burstiness, low=0, open_low=True)
        check_number("speed", self.speed, low=0, open_low=True)
        check_number("start", self.start, low=0)
        if self.window is not None:
            check_number("window", self.window, low=0, open_low=True)
        if self.duration is not None:
            check_number("duration", self.duration, low=0, open_low=True)
        if self.num_requests is not None:
            check_positive_int("num_requests", self.num_requests)
        if self.duration is None and self.num_requests is None and self.window is None:
            raise ValueError("give a duration, a number of requests or a trace window")


@dataclass(frozen=True)
class Limits:
    """Length scaling and caps, applied after lengths are drawn or read."""

    scale_tokens: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        check_number("scale_tokens", self.scale_tokens, low=0, open_low=True)
        for name in ("max_prompt_tokens", "max_output_tokens"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))

    def apply(self, r: TraceRequest) -> TraceRequest:
        prompt = max(1, round(r.prompt_tokens * self.scale_tokens))
        output = max(1, round(r.output_tokens * self.scale_tokens))
        if self.max_prompt_tokens is not None:
            prompt = min(prompt, self.max_prompt_tokens)
        if self.max_output_tokens is not None:
            output = min(output, self.max_output_tokens)
        # Prefix blocks shrink with the prompt so that equal hashes still mean equal text.
        block = max(1, round(r.block_tokens * self.scale_tokens))
        hashes = r.prefix_hashes[: math.ceil(prompt / block)]
        max_tokens = None if r.max_tokens is None else max(output, r.max_tokens)
        return replace(
            r,
            # a kept text is sent only at its own length: scaled or capped, made-up text is
            prompt=r.prompt if prompt == r.prompt_tokens else None,
            prompt_tokens=prompt,
            output_tokens=output,
            block_tokens=block,
            prefix_hashes=hashes,
            max_tokens=max_tokens,
        )


@dataclass(frozen=True)
class TenantMix:
    tenant: str | None  # None: each request keeps its own (a trace's tenants, "default" else)
    workload: Workload
    api_key: str | None = None
    priority: str | None = None
    share: float | None = None  # fraction of the total rate
    rate: float | None = None  # or a rate of its own


@dataclass(frozen=True)
class MixSpec:
    tenants: tuple[TenantMix, ...]
    shape: LoadShape = field(default_factory=LoadShape)
    model: str | None = None  # None: the server's (its first of GET /v1/models)

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a model name, got {self.model!r}")


# ----------------------------------------------------------------------------- registry


def traces_dir() -> Path:
    """$FAIRGATE_TRACES_DIR, else shared/data/traces beside or inside the repository."""
    env = os.environ.get("FAIRGATE_TRACES_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent
    for candidate in (repo.parent / "shared/data/traces", repo / "shared/data/traces"):
        if candidate.is_dir():
            return candidate
    return repo.parent / "shared/data/traces"


def _registry() -> dict[str, Callable[[], Workload]]:
    tdir = traces_dir
    return {
        "fixed": lambda: Synthetic("fixed", Lengths.parse(512), Lengths.parse(128)),
        "uniform": lambda: Synthetic(
            "uniform", Lengths.parse([64, 2048]), Lengths.parse([16, 512])
        ),
        "longtail": lambda: Synthetic(
            "longtail",
            Lengths("lognormal", value=600, low=8, high=30_000, sigma=1.0, tail_prob=0.005),
            Lengths("lognormal", value=150, low=1, high=4096, sigma=0.8),
        ),
        "shared-prefix": lambda: Synthetic(
            "shared-prefix",
            Lengths.parse([64, 512]),
            Lengths.parse(128),
            prefix_groups=8,
            prefix_tokens=2048,
        ),
        "azure-conv": lambda: TraceReplay("azure-conv", tdir() / "azure_llm_2023_conv.csv"),
        "azure-code": lambda: TraceReplay("azure-code", tdir() / "azure_llm_2023_code.csv"),
        "mooncake": lambda: TraceReplay("mooncake", tdir() / "mooncake_conversation.jsonl"),
    }


WORKLOADS: tuple[str, ...] = tuple(_registry())


def get_workload(name: str) -> Workload:
    factory = _registry().get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    return factory()


def parse_workload(spec: Any, base_dir: Path | None = None) -> Workload:
    """A registry name, or an inline mapping (see the module docstring)."""
    if isinstance(spec, Synthetic | TraceReplay):
        return spec
    if isinstance(spec, str):
        return get_workload(spec)
    if not isinstance(spec, dict):
        raise ValueError(f"a workload is a name or a mapping, got {spec!r}")
    spec = dict(spec)
    if "trace" in spec:
        path = Path(spec.pop("trace"))
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        return TraceReplay(str(spec.pop("name", path.stem)), path, str(spec.pop("format", "auto")))
    base = spec.pop("base", None) or spec.pop("kind", None)
    if base is None:
        raise ValueError(f"an inline workload needs 'kind', 'base' or 'trace': {spec!r}")
    start = get_workload(base) if base in WORKLOADS else Synthetic(base, Lengths(), Lengths())
    if not isinstance(start, Synthetic):
        raise ValueError(f"{base!r} is a trace; use {{trace: PATH}} to replay a file")
    for key in ("prompt_tokens", "output_tokens"):
        if key in spec:
            spec[key] = Lengths.parse(spec[key])
    check_known_keys("workload", spec, [f.name for f in dataclasses.fields(Synthetic)])
    return replace(start, **spec)


def load_workload_file(path: str | Path) -> MixSpec:
    """Read a YAML or JSON tenant-mix file (format in the module docstring)."""
    from protocol.yaml_files import load_yaml  # only workload files need YAML

    path = Path(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: {exc}") from None
    else:
        data = load_yaml(path)  # YamlError names the file and the line itself
    try:
        return _parse_mix(data, path)
    except (ValueError, TypeError) as exc:  # bad values and wrong types: one line naming the file
        raise ValueError(f"{path}: {exc}") from None


def _parse_mix(data: Any, path: Path) -> MixSpec:
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
        raise ValueError("a workload file is a mapping with a 'tenants' list")
    shape_keys = [f.name for f in dataclasses.fields(LoadShape)]
    check_known_keys("workload file", data, [*shape_keys, "tenants", "model"])
    shape = LoadShape(**{k: v for k, v in data.items() if k in shape_keys})
    tenants = tuple(_parse_tenant(t, path) for t in data["tenants"])
    return MixSpec(tenants, shape, data.get("model"))


def _parse_tenant(entry: Any, path: Path) -> TenantMix:
    if not isinstance(entry, dict) or "tenant" not in entry:
        raise ValueError(f"each tenant entry needs a 'tenant' name, got {entry!r}")
    entry = dict(entry)
    entry["workload"] = parse_workload(entry.get("workload", "fixed"), path.parent)
    return from_mapping(TenantMix, entry, "tenant")


# ----------------------------------------------------------------------------- building


def build_requests(
    workload: Workload,
    shape: LoadShape | None = None,
    limits: Limits | None = None,
) -> list[TraceRequest]:
    """The requests of one workload for one tenant ("default"), sorted by arrival."""
    shape = shape or LoadShape()
    limits = limits or Limits()
    if isinstance(workload, Synthetic):
        requests = _synthetic(workload, shape)
    else:
        requests = _replay(workload, shape)
    return [limits.apply(r) for r in _cut(requests, shape)]


def build_mix(spec: MixSpec, limits: Limits | None = None) -> list[TraceRequest]:
    """Every tenant's requests, merged by arrival. A tenant's rate is its own `rate`, else its
    `share` of the total rate, else an equal share when a total rate is given."""
    shape = spec.shape
    shares = [t.share for t in spec.tenants]
    if shape.rate is None and any(s is not None for s in shares):
        raise ValueError("tenant shares need a total rate (--rate or 'rate:' in the file)")
    merged: list[TraceRequest] = []
    for i, t in enumerate(spec.tenants):
        rate = t.rate
        if rate is None and shape.rate is not None:
            rate = shape.rate * (t.share if t.share is not None else 1.0 / len(spec.tenants))
        # Each tenant gets its own random stream so adding a tenant does not reshuffle the rest;
        # each draws up to the whole count, the merge below keeps the earliest.
        tenant_shape = replace(shape, rate=rate, seed=shape.seed + 1009 * i)
        for r in build_requests(t.workload, tenant_shape, limits):
            merged.append(
                replace(r, tenant=r.tenant if t.tenant is None else t.tenant,
                        priority=t.priority or r.priority, api_key=t.api_key)
            )
    merged.sort(key=lambda r: r.arrival)
    return merged[: shape.num_requests] if shape.num_requests is not None else merged


def arrival_times(
    rate: float, n: int, process: str, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """n arrival offsets (first at 0) with mean rate `rate`. Gamma gaps with shape `burstiness`
    keep the mean but change the variance: shape 1 is Poisson, smaller is burstier."""
    if n <= 0:
        return np.zeros(0)
    if process == "constant" or math.isinf(rate):
        gaps = np.full(n, 0.0 if math.isinf(rate) else 1.0 / rate)
    elif process == "gamma":
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    else:
        gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _count(shape: LoadShape, rate: float) -> int:
    """How many requests to draw: enough to fill the duration (cut afterwards)."""
    if math.isinf(rate) and shape.num_requests is None:
        raise ValueError("an infinite rate sends everything at once: give a number of requests")
    if shape.duration is None or math.isinf(rate):
        assert shape.num_requests is not None  # LoadShape insists on a duration or a count
        return shape.num_requests
    expected = rate * shape.duration
    enough = int(expected + 6 * math.sqrt(expected / min(1.0, shape.burstiness)) + 16)
    return min(enough, shape.num_requests) if shape.num_requests is not None else enough


def _synthetic(w: Synthetic, shape: LoadShape) -> list[TraceRequest]:
    if shape.arrivals == "trace":
        raise ValueError(f"workload {w.name!r} is synthetic: arrivals 'trace' needs a trace")
    rng = np.random.default_rng(shape.seed)
    rate = (shape.rate or w.default_rate) * shape.speed
    n = _count(shape, rate)
    # A burstiness other than 1 only means something for gamma gaps, so it implies them.
    process = shape.arrivals or ("poisson" if shape.burstiness == 1.0 else "gamma")
    arrivals = arrival_times(rate, n, process, shape.burstiness, rng)
    prompts = w.prompt_tokens.sample(rng, n)
    outputs = w.output_tokens.sample(rng, n)
    groups = rng.integers(0, max(1, w.prefix_groups), n)
    requests = []
    for t, p, o, g in zip(
        arrivals.tolist(), prompts.tolist(), outputs.tolist(), groups.tolist(), strict=True
    ):
        if w.prefix_groups and w.prefix_tokens:
            # One block covering the whole shared prefix: equal group = identical text.
            requests.append(
                TraceRequest(
                    t, w.prefix_tokens + p, o, prefix_hashes=(g,), block_tokens=w.prefix_tokens
                )
            )
        else:
            requests.append(TraceRequest(t, p, o))
    return requests


def _replay(w: TraceReplay, shape: LoadShape) -> list[TraceRequest]:
    end = math.inf if shape.window is None else shape.start + shape.window
    trace = [r for r in load_trace(w.path, w.format) if shape.start <= r.arrival < end]
    if not trace:
        raise ValueError(f"trace {w.path} has no requests " + (
            f"after {shape.start:g} s" if shape.window is None
            else f"from {shape.start:g} s to {end:g} s"))
    t0 = trace[0].arrival if shape.window is None else shape.start
    span = trace[-1].arrival - t0
    native_rate = (len(trace) - 1) / span if span > 0 else math.inf
    if shape.window is not None:
        native_rate = len(trace) / shape.window
    elif shape.rate is not None and shape.duration is not None and (
            shape.arrivals or "trace") == "trace" and not math.isinf(shape.rate):
        # --rate R for --duration D: the next R x D requests, replayed over D seconds, so R
        # is their mean rate (not the rest of the trace's, which a cut to D would distort)
        trace = trace[:max(1, math.ceil(shape.rate * shape.duration - 1e-9))]
        covered = max(trace[-1].arrival - t0, 1e-6) * (1 + 1e-9) + 1e-9  # the last one inside
        # the factor maps `covered` to D (or, for a trace that ends first, to its requests / R)
        native_rate = min(shape.rate * shape.duration, len(trace)) / covered
    process = shape.arrivals or "trace"
    if process == "trace":
        # A rate override rescales time, so the trace's bursts keep their shape.
        factor = shape.rate / native_rate if shape.rate is not None else shape.speed
        return [replace(r, arrival=(r.arrival - t0) / factor) for r in trace]
    rate = shape.rate if shape.rate is not None else native_rate * shape.speed
    n = min(len(trace), _count(shape, rate))
    times = arrival_times(rate, n, process, shape.burstiness, np.random.default_rng(shape.seed))
    return [replace(r, arrival=t) for r, t in zip(trace[:n], times.tolist(), strict=True)]


def _cut(requests: list[TraceRequest], shape: LoadShape) -> list[TraceRequest]:
    if shape.duration is not None:
        requests = [r for r in requests if r.arrival < shape.duration]
    if shape.num_requests is not None:
        requests = requests[: shape.num_requests]
    return requests


# ----------------------------------------------------------------------------- prompt text


class TokensToText(Protocol):
    """Prompt text that the target's tokenizer turns into ~n tokens. Prefix block ids come
    first, each `block_tokens` long: the same id always gives the same text (within one
    generator), so equal ids share a prefix; `seed` makes the rest unique per request."""

    def __call__(
        self, n: int, seed: int, prefix_blocks: Sequence[int] = (), block_tokens: int = BLOCK_TOKENS
    ) -> str: ...


class _PooledText:
    """Text cut from a fixed random pool: O(n) slicing, no per-token random draws."""

    pool_size = 1 << 16
    bos_tokens = 0

    def __init__(self, salt: int = 0) -> None:
        # The salt keeps one run's prompts (and prefixes) out of another run's prefix cache.
        self.salt = salt

    def __call__(
        self, n: int, seed: int, prefix_blocks: Sequence[int] = (), block_tokens: int = BLOCK_TOKENS
    ) -> str:
        remaining = max(1, n - self.bos_tokens)
        parts = []
        for h in prefix_blocks:
            if remaining <= 0:
                break
            take = min(block_tokens, remaining)
            # A partial block is a prefix of the full one, so partial shares stay shared.
            parts.append(self._run(f"<{self.salt}:{h}>", h * 7919, take))
            remaining -= take
        if remaining > 0:
            parts.append(self._run(f"[{self.salt}:{seed}]", seed * 104_729, remaining))
        return "".join(parts)

    def _run(self, tag: str, offset: int, n: int) -> str:
        """n tokens starting with `tag`; a shorter run is a prefix of a longer one."""
        raise NotImplementedError


class ByteText(_PooledText):
    """fairgate's byte-level tokenizer: one token per ASCII character, plus BOS."""

    bos_tokens = 1

    def _run(self, tag: str, offset: int, n: int) -> str:
        return (tag + _chars(offset % self.pool_size, n))[:n]


class WordText(_PooledText):
    """About one token per word for BPE vocabularies (Llama, GPT): " the", " time", ..."""

    bos_tokens = 1

    def _run(self, tag: str, offset: int, n: int) -> str:
        return " " + tag + _words(offset % self.pool_size, n - 1) if n > 0 else ""


_ALPHABET = b"abcdefghijklmnopqrstuvwxyz      "  # 32 symbols: a byte's low 5 bits pick one


@cache
def _pool() -> str:
    # Letters with spaces: ASCII (1 byte = 1 token), word-like for any tokenizer's sake.
    table = bytes(_ALPHABET[i % 32] for i in range(256))
    return random.Random(0).randbytes(1 << 17).translate(table).decode("ascii")


def _chars(offset: int, n: int) -> str:
    pool = _pool()
    if offset + n <= len(pool):
        return pool[offset : offset + n]
    return (pool * (1 + (offset + n) // len(pool)))[offset : offset + n]


_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their has been more when will would who "
    "so no if out time up only some could them my than first then its also new two may into any"
)
_WORDS = tuple(_WORD_TEXT.split())


def _words(offset: int, n: int) -> str:
    if n <= 0:
        return ""
    return "".join(" " + _WORDS[(offset + i * 7) % len(_WORDS)] for i in range(n))


TOKENIZERS: dict[str, Callable[[int], TokensToText]] = {"byte": ByteText, "words": WordText}


def byte_tokens_to_text(
    n: int, seed: int, prefix_blocks: Sequence[int] = (), block_tokens: int = BLOCK_TOKENS
) -> str:
    """`ByteText` with salt 0, as a plain function."""
    return ByteText(0)(n, seed, prefix_blocks, block_tokens)
