"""Trial runners over HTTP: `replay` (a running `fairgate engine`, reconfigured per trial) and
`launch` (a server started per trial from a command template).

Both replay the workload with the load generator (`tuner.loadgen`) in real time and hand the
study the same shape of result as sim mode (`HttpRun`, like `tuner.simulate.SimResult`), with
client-side TTFT and token times. The study's early-stop rule is asked as each request
finishes: once the trial cannot meet a p99 any more nothing more is sent and the requests in
flight are cancelled (counted as misses), so a hopeless config costs seconds, not the whole
workload. Beside the client's figures, the engine's own `/stats` window over the run is kept
(`engine_stats`) as a cross-check; a server without `/stats` gives None.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shlex
import signal
import socket
import string
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine.config import EngineConfig
from protocol.measures import RequestTiming
from tuner.loadgen import BenchError, RunOptions, Target, run_workload_sync
from tuner.report import Report, RequestResult
from tuner.traces import TraceRequest

StopRule = Callable[[list[RequestTiming]], str | None]
READY_TIMEOUT_S = 60.0  # after a reconfiguration
POLL_S = 0.05
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL
OUTPUT_LINES = 20  # of a launched server's output, kept for the message when it fails
PORT = "port"


@dataclass(frozen=True)
class HttpRun:
    """One replay over HTTP: the fields of tuner.simulate.SimResult, on the client's clock."""

    timings: list[RequestTiming]  # one per planned request, in workload order
    elapsed_s: float  # from the first send to the last finish
    stopped: str | None  # the early-stop rule's reason: the run was cut short there
    steps: int  # engine steps during the run (from /load; 0 when the server has none)
    wall_s: float
    preemptions: int
    engine_stats: dict[str, Any] | None = None  # the engine's /stats over the run


def timing_of(result: RequestResult) -> RequestTiming:
    """The load generator's result on the run's clock; a failed request is ok=False."""
    timing = result.timing
    if timing is None or not result.ok:
        return RequestTiming(result.start, [], 0, result.start, ok=False)
    stamps = [result.start + t for t in timing.token_times]
    return RequestTiming(result.start, stamps, timing.num_output_tokens,
                         result.start + timing.end, ok=True)


def replay_http(base_url: str, api_key: str | None, requests: Sequence[TraceRequest],
                stop: StopRule) -> HttpRun:
    """Send `requests` on schedule to `base_url` and measure, stopping once `stop` says the
    trial can no longer meet its SLOs; ValueError when it cannot run."""
    before = load_counters(base_url, api_key)
    reason: list[str] = []
    finished: list[RequestTiming] = []  # append-only: the rule counts only what is new

    def cut(result: RequestResult) -> bool:
        finished.append(timing_of(result))
        why = stop(finished)
        if why is not None:
            reason.append(why)
        return why is not None

    started = time.monotonic()
    try:
        report: Report = run_workload_sync(list(requests), Target(base_url, api_key),
                                           options=RunOptions(), stop=cut)
    except BenchError as exc:
        raise ValueError(str(exc)) from None
    after = load_counters(base_url, api_key)
    timings = [timing_of(r) for r in report.results]
    return HttpRun(timings=timings, elapsed_s=report.duration,
                   stopped=reason[0] if reason else None, steps=after[0] - before[0],
                   wall_s=report.duration, preemptions=after[1] - before[1],
                   engine_stats=engine_window(base_url, api_key, time.monotonic() - started))


def engine_window(base_url: str, api_key: str | None, seconds: float) -> dict[str, Any] | None:
    """p99 TTFT and TPOT, and how many requests got a first token, from a fairgate engine's
    `/stats` over the last `seconds` (the trial's run); None for a server without it."""
    try:
        status, body = request_json(f"{base_url}/stats?window={max(seconds, 0.001):.3f}",
                                    api_key)
    except OSError:
        return None
    ttft, tpot = body.get("ttft"), body.get("tpot")
    if status != 200 or not isinstance(ttft, dict) or not isinstance(tpot, dict):
        return None
    # requests that finished with a first token: cancelled ones (a cut-short run) do not count
    return {"p99_ttft_s": ttft.get("p99"), "p99_tpot_s": tpot.get("p99"),
            "requests": ttft.get("count")}


# ----------------------------------------------------------------------------- HTTP helpers


def request_json(url: str, api_key: str | None, body: dict[str, Any] | None = None,
                 timeout: float = 10.0, method: str | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET (or a POST of `body`, or `method`); OSError when
    unreachable."""
    status, raw = request_bytes(url, api_key, body, timeout, method)
    return status, _json(raw)


def request_bytes(url: str, api_key: str | None, body: dict[str, Any] | None = None,
                  timeout: float = 10.0, method: str | None = None) -> tuple[int, bytes]:
    """(status, raw body) of a GET (or a POST of `body`, or `method`); OSError when
    unreachable."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method=method or ("GET" if body is None else "POST"))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_text(body: dict[str, Any], status: int) -> str:
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return str(message) if message else f"HTTP {status}"


def load_counters(base_url: str, api_key: str | None) -> tuple[int, int]:
    """(steps, preemptions) so far from a fairgate engine's /load; zeros for other servers."""
    try:
        status, body = request_json(f"{base_url}/load", api_key)
    except OSError:
        return 0, 0
    if status != 200:
        return 0, 0
    return int(body.get("num_steps", 0)), int(body.get("num_preemptions", 0))


def wait_until(ready: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Poll `ready` (a remote server's state) until true; ValueError after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not ready():
        if time.monotonic() >= deadline:
            raise ValueError(f"{what} after {deadline_s:g} s")
        time.sleep(POLL_S)


# ----------------------------------------------------------------------------- replay


def check_reachable(url: str, api_key: str | None) -> None:
    """ValueError (one line) unless `url` answers /readyz."""
    try:
        request_json(f"{url.rstrip('/')}/readyz", api_key, timeout=5.0)
    except OSError as exc:
        raise ValueError(f"cannot reach --url {url}: {getattr(exc, 'reason', exc)}") from None


class ReplayRunner:
    """A running `fairgate engine`: each trial's knobs go to /admin/reconfigure (weights stay
    loaded); a knob the engine refuses (one that needs a restart) makes the trial infeasible
    with the engine's message."""

    def __init__(self, url: str, api_key: str | None, knobs: Sequence[str]) -> None:
        self.url, self.api_key, self.knobs = url.rstrip("/"), api_key, tuple(knobs)

    def prepare(self, config: EngineConfig) -> EngineConfig:
        return config

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> HttpRun:
        self.reconfigure(config)
        return replay_http(self.url, self.api_key, requests, stop)

    def reconfigure(self, config: EngineConfig) -> None:
        values = config.to_dict()
        changes = {k: values[k] for k in self.knobs}
        try:
            status, body = request_json(f"{self.url}/admin/reconfigure", self.api_key,
                                        {"changes": changes}, timeout=READY_TIMEOUT_S)
        except OSError as exc:
            raise ValueError(f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}") from None
        if status != 200:
            raise ValueError(f"the engine refused the knobs: {error_text(body, status)}")
        wait_until(self.ready, READY_TIMEOUT_S, "the engine was not ready again")

    def ready(self) -> bool:
        try:
            status, body = request_json(f"{self.url}/readyz", self.api_key)
        except OSError:
            return False
        return status == 200 and not body.get("reconfiguring", False)


# ----------------------------------------------------------------------------- launch


def check_template(command: str) -> list[str]:
    """The template split into argv (no shell); ValueError for an empty one or a placeholder
    that is neither {port} nor an engine knob."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"--command cannot be split: {exc}") from None
    if not argv:
        raise ValueError("--command is empty")
    known = {f.name for f in fields(EngineConfig)} | {PORT}
    for arg in argv:
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(arg) if name is not None]
        except ValueError as exc:
            raise ValueError(f"--command {arg!r}: {exc}") from None
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--command has unknown placeholder {{{unknown[0]}}}; use {{port}} "
                             "or an engine knob such as {max_num_seqs}")
    return argv


def fill_template(argv: Sequence[str], config: EngineConfig, port: int) -> list[str]:
    """Each argument with the knobs filled in as YAML scalars (null, true), so `--set K=V`
    reads them back."""
    values = {k: _scalar(v) for k, v in config.to_dict().items()} | {PORT: str(port)}
    return [arg.format(**values) for arg in argv]


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LaunchedServer:
    """One server process: its output drained into a short tail (so it never blocks on a full
    pipe), stopped with SIGTERM and then SIGKILL."""

    def __init__(self, argv: Sequence[str]) -> None:
        try:
            # a session of its own: stopping it stops whatever it started (a wrapper script's
            # server, a launcher's workers) as well
            self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as exc:
            raise ValueError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        self.tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.decode(errors="replace").rstrip())

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def output(self) -> str:
        self._reader.join(timeout=1.0)
        return " | ".join(line for line in self.tail if line) or "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=1.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class LaunchRunner:
    """A server per trial from a command template with the knobs and a free {port} filled in;
    waits for /health, replays, and always stops it."""

    def __init__(self, command: str, api_key: str | None, launch_timeout_s: float) -> None:
        self.argv = check_template(command)
        self.api_key, self.launch_timeout_s = api_key, launch_timeout_s

    def prepare(self, config: EngineConfig) -> EngineConfig:
        return config

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> HttpRun:
        port = free_port()
        server = LaunchedServer(fill_template(self.argv, config, port))
        try:
            self._wait_healthy(server, f"http://127.0.0.1:{port}")
            return replay_http(f"http://127.0.0.1:{port}", self.api_key, requests, stop)
        finally:
            server.stop()

    def _wait_healthy(self, server: LaunchedServer, url: str) -> None:
        def healthy() -> bool:
            if server.proc.poll() is not None:
                raise ValueError(f"the server exited with status {server.proc.returncode}: "
                                 f"{server.output()}")
            try:
                return request_json(f"{url}/health", self.api_key, timeout=2.0)[0] == 200
            except OSError:
                return False

        try:
            wait_until(healthy, self.launch_timeout_s, "the server never became healthy")
        except ValueError as exc:
            if server.proc.poll() is None:
                raise ValueError(f"{exc}: {server.output()}") from None
            raise
