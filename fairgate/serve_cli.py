"""`fairgate serve [-c fairgate.yaml]`: the gateway with an embedded or remote engines, and its
control plane (control.app: tune jobs, canary, shadow traffic, capture, dashboard)."""

from __future__ import annotations

import argparse
import os

from control.app import make_app
from engine.heap import size_young_generation
from engine.server import freeze_startup_heap, install_fast_event_loop
from fairgate.config import FairgateConfig
from gateway.app import DEMO_TENANT, make_metrics_app, server_options
from gateway.config import ADMIN_KEY_ENV
from protocol.serving import serve, setup_logging


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", default=None,
                        help="fairgate.yaml (default: built-in defaults, embedded random:tiny)")
    parser.add_argument("--host", default=None, help="override gateway.host")
    parser.add_argument("--port", type=int, default=None, help="override gateway.port")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="the least severe log lines printed (default INFO)")


def print_demo_key(key: str) -> None:
    # Printed once, to the terminal only: the database keeps just its hash.
    print(f"created tenant {DEMO_TENANT!r}; its API key (shown only now):\n  {key}",
          flush=True)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    config = FairgateConfig.load(args.config, os.environ)
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535 (0: a free one), got {port}")
    app = make_app(config.gateway, engine=config.engine, database=config.database,
                   on_demo_key=print_demo_key)
    app.on_startup.append(freeze_startup_heap)  # after the database and backends started
    backends = ", ".join(b.url for b in config.gateway.backends) or (
        f"embedded {config.engine.model} ({config.engine.executor})")
    admin = (f"${ADMIN_KEY_ENV}" if os.environ.get(ADMIN_KEY_ENV) else  # it wins over the file
             "gateway.admin_key" if config.gateway.admin_key else "off")
    settings = config.gateway
    extra = [] if settings.metrics_port is None else [
        (make_metrics_app(app), settings.metrics_host, settings.metrics_port)]

    def listening(bound: list[tuple[str, int]]) -> None:
        # Only now: a port in use is the one error line, with no banner before it.
        print(f"fairgate gateway on http://{host}:{bound[0][1]} -> {backends}; "
              f"dispatch={config.gateway.dispatch}; admin key: {admin}", flush=True)
        if extra:
            metrics_host, metrics_port = bound[1]
            print(f"metrics on http://{metrics_host}:{metrics_port}/metrics", flush=True)

    install_fast_event_loop()
    if not config.gateway.backends:  # the engine steps in this process
        size_young_generation(config.engine.max_num_seqs)
    # OSError (an address in use): the dispatcher's one line and exit 2
    serve(app, host, port, extra=extra, on_listening=listening, **server_options(settings))
    return 0
