"""`fairgate engine`: a standalone engine server.

    fairgate engine [-c fairgate.yaml] [--port 8100] [--host 127.0.0.1]
                    [--set KNOB=VALUE ...] [--metrics-compat vllm]
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import yaml

from engine.config import EngineConfig
from engine.metrics import COMPAT_CHOICES
from fairgate.config import load_config_file, section
from protocol.serving import serve, setup_logging

DEFAULT_PORT = 8100
DEFAULT_HOST = "127.0.0.1"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="FILE",
                        help="fairgate.yaml; its `engine` section sets the knobs")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"default {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KNOB=VALUE",
                        help="override one engine knob (YAML value), e.g. --set max_num_seqs=32")
    parser.add_argument("--metrics-compat", choices=COMPAT_CHOICES, default=None,
                        help="also export vLLM's metric names")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KNOB=VALUE` pairs; values are read as YAML scalars (32, 0.9, true, null, fcfs)."""
    overrides: dict[str, Any] = {}
    for item in items:
        knob, sep, raw = item.partition("=")
        if not sep or not knob.strip():
            raise ValueError(f"--set expects KNOB=VALUE, got {item!r}")
        try:
            overrides[knob.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ValueError(f"--set {knob}: cannot read the value {raw!r}") from None
    return overrides


def build_config(config_file: str | None, overrides: list[str]) -> EngineConfig:
    """The engine section of the file with `--set` overrides on top; ValueError when wrong."""
    values = dict(section(load_config_file(config_file), "engine"))
    values.update(parse_overrides(overrides))
    try:
        return EngineConfig.from_dict(values)
    except TypeError as exc:  # a wrongly typed value compared during validation
        raise ValueError(f"invalid engine setting: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncEngine
    from engine.server import freeze_startup_heap, install_fast_event_loop, make_app

    setup_logging(args.log_level.upper())
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    config = build_config(args.config, args.overrides)
    engine = AsyncEngine(config)  # loads the model before the port opens
    app = make_app(engine, metrics_compat=args.metrics_compat)
    app.on_startup.append(freeze_startup_heap)  # after the engine context started
    install_fast_event_loop()
    # handler_cancellation: a client that hangs up on a non-streamed request aborts it too
    serve(app, args.host, args.port, handler_cancellation=True,  # OSError: the port is taken
          on_listening=lambda _: logging.getLogger("fairgate.engine").info(
              "serving %s on http://%s:%d", config.model, args.host, args.port))
    return 0
