"""`fairgate engine`: a standalone engine server.

    fairgate engine [MODEL] [-c fairgate.yaml] [--port 8100] [--host 127.0.0.1]
                    [vLLM's flags: --max-num-seqs N --gpu-memory-utilization F ...]
                    [--set KNOB=VALUE ...] [--metrics-compat vllm]
                    [--api-key KEY] [--allow-unauthenticated]

Knobs: the file's `engine` section, then the command line's: `--set KNOB=VALUE` and vLLM's
flags (engine/vllm_flags.py, as `vllm serve MODEL --max-num-seqs 64` takes them). A knob set
both by a flag and by --set is refused; one of vLLM's flags that fairgate does not have is a
one-line error naming it.

Keys (EngineAccess): --api-key, else $FAIRGATE_ENGINE_KEY, else the section's `api_key`; the
admin key $FAIRGATE_ENGINE_ADMIN_KEY, else `admin_key`, else the api key. A --host other
than loopback without an api key is refused unless --allow-unauthenticated.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine.config import (
    METRICS_COMPAT,
    EngineAccess,
    EngineConfig,
    canonical_knobs,
    check_bearer_key,
    is_loopback,
)
from engine.vllm_flags import ENGINE_HOST, ENGINE_PORT, add_flags, knob_values, refuse_flags
from fairgate.config import load_config_file, section
from protocol.serving import serve, setup_logging
from protocol.yaml_files import YamlError, load_yaml

DEFAULT_PORT = ENGINE_PORT
DEFAULT_HOST = ENGINE_HOST
FlagKnobs = Mapping[str, tuple[str, Any]]  # knob -> (the flag that set it, its value)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it: a local checkpoint "
                        "folder or random:PRESET (default: engine.model, else random:tiny)")
    parser.add_argument("-c", "--config", metavar="FILE",
                        help="fairgate.yaml; its `engine` section sets the knobs")
    add_flags(parser)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KNOB=VALUE",
                        help="override one engine knob (YAML value), e.g. --set max_num_seqs=32 "
                        "(a knob one of the flags above also sets is refused)")
    parser.add_argument("--metrics-compat", choices=METRICS_COMPAT, default=None,
                        help="also export vLLM's metric names (the knob metrics_compat)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="the log's threshold (default info)")
    parser.add_argument("--allow-unauthenticated", action="store_true", default=None,
                        help="serve a non-loopback --host without an api key")
    refuse_flags(parser)


def flag_knobs(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """The knobs the command line's vLLM flags and MODEL set; ValueError for a value a flag
    cannot take, or the model given twice."""
    knobs = knob_values(args)
    if hasattr(args, "model"):
        if "model" in knobs:
            raise ValueError(f"MODEL ({args.model}) and --model both name the model: give one")
        knobs["model"] = ("MODEL", args.model)
    return knobs


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KNOB=VALUE` pairs; values are read as YAML scalars (32, 0.9, true, null, fcfs)."""
    overrides: dict[str, Any] = {}
    for item in items:
        knob, sep, raw = item.partition("=")
        if not sep or not knob.strip():
            raise ValueError(f"--set expects KNOB=VALUE, got {item!r}")
        try:
            overrides[knob.strip()] = load_yaml(f"--set {knob}", text=raw)
        except YamlError:
            raise ValueError(f"--set {knob}: cannot read the value {raw!r}") from None
    return overrides


def engine_section(config_file: str | None, overrides: list[str],
                   flags: FlagKnobs | None = None) -> dict[str, Any]:
    """The engine section of the file with `--set` overrides and `flags` on top, vLLM's key
    names under fairgate's (canonical_knobs); ValueError for a knob a flag and --set both set."""
    values = canonical_knobs(section(load_config_file(config_file), "engine"))
    sets = canonical_knobs(parse_overrides(overrides))
    for knob, (flag, _) in (flags or {}).items():
        if knob in sets:
            raise ValueError(f"{flag} and --set {knob}=... both set {knob}: give one")
    values.update(sets)
    values.update({knob: value for knob, (_, value) in (flags or {}).items()})
    return values


def build_config(config_file: str | None, overrides: list[str],
                 flags: FlagKnobs | None = None) -> EngineConfig:
    """The engine section of the file with `--set` overrides and `flags` on top; ValueError
    when wrong, naming the flag when a flag set the knob it is about."""
    values = engine_section(config_file, overrides, flags)
    try:
        return EngineConfig.from_dict(values)
    except TypeError as exc:  # a wrongly typed value compared during validation
        raise ValueError(f"invalid engine setting: {exc}") from None
    except ValueError as exc:
        knob = str(exc).split(" ", 1)[0]
        if flags and knob in flags:  # the user typed --gpu-memory-utilization, not the knob
            raise ValueError(f"{flags[knob][0]}: {exc}") from None
        raise


def build_access(args: argparse.Namespace, environ: Mapping[str, str]) -> EngineAccess:
    """The file's keys (and --set's), the environment's over them, the flags over both;
    ValueError when a key is malformed or `args.host` may not be served without one."""
    access = EngineAccess.from_section(engine_section(args.config, args.overrides))
    access = access.with_environment(environ)
    if args.api_key is not None:
        access = replace(access, api_key=check_bearer_key("--api-key", args.api_key))
    if args.allow_unauthenticated:
        access = replace(access, allow_unauthenticated=True)
    access.check_host(args.host)
    return access


def run(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncEngine
    from engine.heap import size_young_generation
    from engine.server import freeze_startup_heap, install_fast_event_loop, make_app

    setup_logging(args.log_level.upper())
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    config = build_config(args.config, args.overrides, flag_knobs(args))
    if args.metrics_compat is not None:  # the flag wins over the file, as --set does
        config = config.replace(metrics_compat=args.metrics_compat)
    access = build_access(args, os.environ)  # refused before the model loads
    engine = AsyncEngine(config)  # loads the model before the port opens
    app = make_app(engine, access=access)
    app.on_startup.append(freeze_startup_heap)  # after the engine context started
    install_fast_event_loop()
    log = logging.getLogger("fairgate.engine")
    log.info("garbage collector: young generation %d objects (max_num_seqs %d)",
             size_young_generation(config.max_num_seqs), config.max_num_seqs)
    if access.api_key is None and not is_loopback(args.host):  # allow_unauthenticated
        log.warning("no api key: /v1/*, /load and /stats are open to whoever reaches %s",
                    args.host)
    # handler_cancellation: a client that hangs up on a non-streamed request aborts it too
    serve(app, args.host, args.port, handler_cancellation=True,  # OSError: the port is taken
          on_listening=lambda _: log.info("serving %s on http://%s:%d (%s)", _model_text(config),
                                          args.host, args.port, _keys_text(access)))
    return 0


def _keys_text(access: EngineAccess) -> str:
    if access.api_key is None:
        return "open" if access.effective_admin_key is None else "admin key on /admin/*"
    return "api key" + (", admin key on /admin/*" if access.admin_key is not None else "")


def _model_text(config: EngineConfig) -> str:
    if config.served_model_name is None:
        return config.model
    return f"{config.model} as {', '.join(config.served_model_names)}"
