"""`fairgate serve [-c fairgate.yaml]`: the gateway with an embedded or remote engines."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from engine.server import freeze_startup_heap, install_fast_event_loop
from fairgate.config import FairgateConfig
from gateway.app import DEMO_TENANT, make_app


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", default=None,
                        help="fairgate.yaml (default: built-in defaults, embedded random:tiny)")
    parser.add_argument("--host", default=None, help="override gateway.host")
    parser.add_argument("--port", type=int, default=None, help="override gateway.port")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def print_demo_key(key: str) -> None:
    # Printed once, to the terminal only: the database keeps just its hash.
    print(f"created tenant {DEMO_TENANT!r}; its API key (shown only now):\n  {key}",
          flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", stream=sys.stderr)
    config = FairgateConfig.load(args.config)
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    app = make_app(config.gateway, engine=config.engine, database=config.database,
                   on_demo_key=print_demo_key)
    app.on_startup.append(freeze_startup_heap)  # after the database and backends started
    backends = ", ".join(b.url for b in config.gateway.backends) or (
        f"embedded {config.engine.model} ({config.engine.executor})")
    print(f"fairgate gateway on http://{host}:{port} -> {backends}; "
          f"dispatch={config.gateway.dispatch}", flush=True)
    # handler_cancellation: a client that hangs up cancels its handler, which removes it from
    # the queue or aborts its engine request at once.
    install_fast_event_loop()
    web.run_app(app, host=host, port=port, print=None, handler_cancellation=True,
                access_log=None)
    return 0
