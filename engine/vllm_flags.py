"""vLLM's `vllm serve` flags for what fairgate has: one table, `VLLM_FLAGS`.

The table builds `fairgate engine`'s flags (`add_flags`), names the vLLM keys fairgate.yaml
takes for its knobs (`KEY_ALIASES`: gpu_memory_utilization for memory_fraction, ...), gives
`fairgate tune --engine vllm` its flags (`flag_for`) and writes the documentation's table
(`markdown_table`). vLLM's flags fairgate does not have (`NOT_FAIRGATES`) are refused with one
line that names them as vLLM's (`refuse_flags`).

Each flag means what it means to vLLM; `differs` says where fairgate's unit, default or
choices are not vLLM's.
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENGINE_HOST = "127.0.0.1"
ENGINE_PORT = 8100


class Target(enum.Enum):
    """Where a flag's value goes."""

    KNOB = "knob"  # an `engine` key: an EngineConfig knob, or the server's api_key
    SERVER = "server"  # an option of the `fairgate engine` server: its address


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """vLLM's human-readable integer: 1k is 1000, 1K is 1024, 25.6k is 25600 (a fraction only
    where the result is whole)."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        raise ValueError("an integer such as 8192, 8k (8000) or 8K (8192)")
    number, suffix = match.groups()
    value = float(number) * _SUFFIX[suffix]
    if not value.is_integer() or (suffix == "" and "." in number):
        raise ValueError("a whole number of tokens")
    return int(value)


_VLLM_DTYPES = {"half": "float16", "float": "float32"}


def vllm_dtype(text: str) -> str:
    """vLLM's dtype names: `half` is float16, `float` is float32; the others are fairgate's."""
    return _VLLM_DTYPES.get(text, text)


def whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("an integer") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("a number") from None


@dataclass(frozen=True)
class VllmFlag:
    """One of vLLM's flags and what it sets here (`name`: the knob, or the server option)."""

    flag: str
    name: str
    meaning: str
    target: Target = Target.KNOB
    convert: Callable[[str], Any] = str
    metavar: str | None = None
    several: bool = False  # takes one or more values (vLLM's nargs="+")
    boolean: bool = False  # --flag and --no-flag
    default: Any = None  # SERVER flags only: knobs default to the engine section
    differs: str = ""

    @property
    def vllm_key(self) -> str:
        """vLLM's own name for the setting (`--gpu-memory-utilization`: gpu_memory_utilization)."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def dest(self) -> str:
        """The argparse attribute: a knob flag's own, since two flags may set one knob."""
        return self.name if self.target is Target.SERVER else f"vllm_flag:{self.flag}"

    def value(self, given: Any) -> Any:
        """The knob's value for what the command line gave; ValueError naming the flag."""
        if self.boolean:
            return bool(given)
        try:
            if self.several:
                return [self.convert(item) for item in given]
            return self.convert(given)
        except ValueError as error:
            raise ValueError(f"{self.flag} expects {error}, got {given!r}") from None


_SWAP = "used by `preemption: swap` only (vLLM V1 always recomputes)"
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag("--model", "model", "the model: a local checkpoint folder or random:PRESET "
             "(the positional MODEL says the same)", metavar="MODEL",
             differs="a local folder only: nothing is downloaded"),
    VllmFlag("--served-model-name", "served_model_name", "the name(s) the API serves the model "
             "under; the first is the id in /v1/models, in responses and in the model_name "
             "label (default: MODEL, which stays accepted as an alias)", several=True,
             metavar="NAME", differs="MODEL stays accepted in requests"),
    VllmFlag("--max-num-seqs", "max_num_seqs", "requests running at once", convert=whole,
             metavar="N", differs="default 64 (vLLM's depends on the GPU)"),
    VllmFlag("--max-num-batched-tokens", "max_num_batched_tokens",
             "tokens per forward pass (the token budget)", convert=human_int, metavar="N",
             differs="default 2048"),
    VllmFlag("--max-model-len", "max_model_len", "prompt + output tokens per request "
             "(default: the model's context); 8k is 8000, 8K is 8192", convert=human_int,
             metavar="N", differs="no -1/auto (fit to memory)"),
    VllmFlag("--gpu-memory-utilization", "memory_fraction", "share of device memory for the "
             "weights, activations and KV cache", convert=number, metavar="FRACTION"),
    VllmFlag("--kv-cache-dtype", "kv_cache_dtype", "KV cache storage: auto (the model's "
             "dtype) or int8 (per-token scales)", metavar="DTYPE",
             differs="int8, not vLLM's fp8 variants"),
    VllmFlag("--block-size", "block_size", "tokens per KV block", convert=whole, metavar="N",
             differs="any power of two"),
    VllmFlag("--swap-space", "swap_space_gb", f"host memory for swapped-out blocks, in GiB; "
             f"{_SWAP}", convert=number, metavar="GIB", differs="default 1 GiB (vLLM: 4)"),
    VllmFlag("--num-gpu-blocks-override", "num_kv_blocks", "KV blocks to allocate instead of "
             "the profiled count", convert=whole, metavar="N"),
    VllmFlag("--enable-prefix-caching", "enable_prefix_caching", "reuse the KV blocks of "
             "shared prompt prefixes (per tenant); --no-enable-prefix-caching turns it off",
             boolean=True, differs="a tenant's cached blocks serve only that tenant"),
    VllmFlag("--long-prefill-token-threshold", "long_prefill_token_threshold", "cap on one "
             "request's prefill chunk per step (0: none)", convert=human_int, metavar="N"),
    VllmFlag("--max-num-partial-prefills", "max_num_partial_prefills", "prompts part-way "
             "through prefill at once", convert=whole, metavar="N"),
    VllmFlag("--dtype", "dtype", "weights and activations: auto, float16 (half), bfloat16, "
             "float32 (float)", convert=vllm_dtype, metavar="DTYPE"),
    VllmFlag("--seed", "seed", "random seed of the random:PRESET weights and the simulated "
             "executor's tokens", convert=whole, metavar="N",
             differs="does not seed sampling (a request's `seed` does); default 0"),
    VllmFlag("--host", "host", "address to listen on", target=Target.SERVER,
             default=ENGINE_HOST, metavar="HOST",
             differs=f"default {ENGINE_HOST} (vLLM: every address); another address "
             "needs --api-key or --allow-unauthenticated"),
    VllmFlag("--port", "port", "port to listen on", target=Target.SERVER, convert=int,
             default=ENGINE_PORT, metavar="PORT", differs=f"default {ENGINE_PORT} (vLLM: 8000)"),
    VllmFlag("--api-key", "api_key", "the bearer key /v1/*, /load and /stats want (and "
             "/admin/* without an admin key), over the environment's and engine.api_key",
             target=Target.SERVER, metavar="KEY",
             differs="one key of 16 characters or more"),
)
KNOB_FLAGS = tuple(f for f in VLLM_FLAGS if f.target is Target.KNOB)
# vLLM's key for a knob whose fairgate name differs: fairgate.yaml and --set accept both
KEY_ALIASES: Mapping[str, str] = {f.vllm_key: f.name for f in KNOB_FLAGS if f.vllm_key != f.name}


def flag_for(knob: str) -> str:
    """vLLM's flag for `knob`; KeyError when vLLM has none."""
    return next(f.flag for f in KNOB_FLAGS if f.name == knob)


_ONE_GPU = "fairgate runs one GPU per engine; run more engines behind the gateway"
_LOCAL = "fairgate loads a local checkpoint folder and downloads nothing"
_NO_LORA = "fairgate serves no LoRA adapters"
# vLLM's common `vllm serve` flags that fairgate does not have -> why, or what to use instead
NOT_FAIRGATES: Mapping[tuple[str, ...], str] = {
    ("--tensor-parallel-size", "-tp"): _ONE_GPU,
    ("--pipeline-parallel-size", "-pp"): _ONE_GPU,
    ("--data-parallel-size", "-dp"): _ONE_GPU,
    ("--distributed-executor-backend",): _ONE_GPU,
    ("--enable-expert-parallel",): _ONE_GPU,
    ("--disable-custom-all-reduce",): _ONE_GPU,
    ("--quantization", "-q"): "fairgate runs unquantized weights; --kv-cache-dtype int8 "
                              "quantizes the KV cache",
    ("--enforce-eager",): "fairgate's engine always runs eagerly, without CUDA graphs",
    ("--trust-remote-code",): "fairgate runs its own Llama-family model code, never a "
                              "checkpoint's",
    ("--tokenizer", "--tokenizer-mode"): "fairgate reads tokenizer.json from the model folder",
    ("--revision", "--code-revision", "--tokenizer-revision", "--download-dir",
     "--load-format", "--hf-token", "--hf-config-path"): _LOCAL,
    ("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
        "fairgate always chunks long prompts under --max-num-batched-tokens",
    ("--scheduling-policy",): "fairgate's is engine.policy: --set policy=fcfs|priority|sjf|"
                              "prefix|fair",
    ("--disable-log-requests", "--enable-log-requests"): "fairgate's engine logs no requests",
    ("--disable-log-stats",): "fairgate's engine logs no periodic stats",
    ("--uvicorn-log-level",): "use --log-level",
    ("--lora-modules", "--enable-lora", "--max-loras", "--max-lora-rank"): _NO_LORA,
    ("--chat-template",): "fairgate uses the chat template of tokenizer_config.json",
    ("--limit-mm-per-prompt", "--mm-processor-kwargs"): "fairgate serves text models only",
    ("--max-logprobs", "--speculative-config", "--max-long-partial-prefills",
     "--cpu-offload-gb", "--max-seq-len-to-capture", "--cuda-graph-sizes",
     "--compilation-config", "-O", "--kv-transfer-config", "--kv-events-config",
     "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
     "--guided-decoding-backend", "--structured-outputs-config", "--generation-config",
     "--override-generation-config", "--rope-scaling", "--rope-theta", "--hf-overrides",
     "--ssl-keyfile", "--ssl-certfile", "--root-path", "--allowed-origins", "--middleware",
     "--api-server-count", "--disable-frontend-multiprocessing", "--otlp-traces-endpoint",
     "--collect-detailed-traces", "--enable-sleep-mode", "--async-scheduling",
     "--prefix-caching-hash-algo", "--calculate-kv-scales", "--max-parallel-loading-workers",
     "--task", "--runner", "--model-impl", "--skip-tokenizer-init", "--disable-sliding-window",
     "--return-tokens-as-token-ids", "--enable-request-id-headers",
     "--enable-prompt-tokens-details", "--enable-force-include-usage",
     "--enable-server-load-tracking", "--disable-fastapi-docs", "--response-role",
     "--logits-processors", "--show-hidden-metrics-for-version"): "",
}


def refusal(flag: str, why: str) -> str:
    """The one line that refuses vLLM's `flag`."""
    return f"{flag} is a vLLM flag fairgate does not have" + (f" ({why})" if why else "")


class _Refuse(argparse.Action):
    """A vLLM flag fairgate does not have: one line, exit 2, before anything else runs."""

    def __init__(self, option_strings: list[str], dest: str, why: str = "",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        named = option_string or self.option_strings[0]  # the flag typed, not its group's first
        parser.exit(2, f"{parser.prog}: error: {refusal(named, self.why)}\n")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The table's flags on `parser`. A knob flag that is not given leaves no attribute
    (`knob_values` reads the given ones); a SERVER flag has its default."""
    for f in VLLM_FLAGS:
        help_text = f.meaning + (f" [vLLM's, but {f.differs}]" if f.differs else " [vLLM's]")
        default = f.default if f.target is Target.SERVER else argparse.SUPPRESS
        if f.boolean:
            parser.add_argument(f.flag, dest=f.dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif f.target is Target.SERVER:
            parser.add_argument(f.flag, dest=f.dest, type=f.convert, default=default,
                                metavar=f.metavar, help=help_text)
        else:
            parser.add_argument(f.flag, dest=f.dest, default=default, metavar=f.metavar,
                                nargs="+" if f.several else None, help=help_text)


def refuse_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags fairgate does not have on `parser`, each refused with `refusal`."""
    for flags, why in NOT_FAIRGATES.items():
        parser.add_argument(*flags, dest=f"vllm_refused:{flags[0]}", action=_Refuse, why=why,
                            default=argparse.SUPPRESS)


def knob_values(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """{knob: (flag, value)} for the knob flags `args` holds; ValueError for a value the
    flag cannot take, or two flags that set one knob."""
    values: dict[str, tuple[str, Any]] = {}
    for f in KNOB_FLAGS:
        if hasattr(args, f.dest):
            if f.name in values:
                raise ValueError(f"{values[f.name][0]} and {f.flag} both set {f.name}: give one")
            values[f.name] = (f.flag, f.value(getattr(args, f.dest)))
    return values


def markdown_table() -> str:
    """The documentation's table of the flags: vLLM's flag, what it sets here, where it differs."""
    rows = ["| vLLM flag | fairgate | meaning | differs from vLLM |", "| --- | --- | --- | --- |"]
    for f in VLLM_FLAGS:
        flag = "`--[no-]enable-prefix-caching`" if f.boolean else f"`{f.flag}`"
        where = f"`engine.{f.name}`" if f.target is Target.KNOB else f"`fairgate engine {f.flag}`"
        rows.append(f"| {flag} | {where} | {f.meaning} | {f.differs or '-'} |")
    return "\n".join(rows) + "\n"
