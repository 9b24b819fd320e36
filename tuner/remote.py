"""Trial runners over HTTP: `replay` (a running `fairgate engine`, reconfigured per trial) and
`launch` (a server started per trial from a command template).

Replay's base is the engine's own config (/admin/config), and the engine goes back on it when
the study ends (`ReplayRunner.finish`). Launch knows the engine it starts (`tuner.engines`:
vLLM, SGLang, fairgate): it appends that engine's flags for the tuned knobs, a start-up that
runs out of memory is an infeasible trial, and two launches that fail the same other way in a
row stop the study (`LaunchAborted`). A launched server never outlives the tuner: its process
group is stopped with the trial, and killed when the tuner dies, even by SIGKILL.

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
import ctypes
import json
import os
import re
import shlex
import signal
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine.config import ENGINE_ADMIN_KEY_ENV, EngineConfig
from protocol.measures import RequestTiming
from tuner.engines import DEFAULT_ENGINE, LOOPBACK, Engine, engine_named, flag_value, sets_flag
from tuner.loadgen import BenchError, RunOptions, Target, run_workload_sync
from tuner.measures import StopRule
from tuner.report import Report, RequestResult
from tuner.traces import TraceRequest

READY_TIMEOUT_S = 60.0  # after a reconfiguration
POLL_S = 0.05
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL
OUTPUT_LINES = 20  # of a launched server's output, kept for the message when it fails
MESSAGE_LINE_CHARS = 300  # of the log line that names an infeasible start-up
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
    with the engine's message. `api_key` goes with the workload (/v1/*, /load, /stats),
    `admin_key` (None: the api_key) with /admin/config and /admin/reconfigure.

    The study's base is the engine's own config (`prepare` reads /admin/config), not the
    user's -c, and `finish` puts the engine back on it once the study ends, however it ends;
    with `apply` it leaves the engine on the study's winner instead."""

    def __init__(self, url: str, api_key: str | None, knobs: Sequence[str],
                 apply: bool = False, admin_key: str | None = None) -> None:
        self.url, self.api_key, self.knobs = url.rstrip("/"), api_key, tuple(knobs)
        self.admin_key = admin_key if admin_key is not None else api_key
        self.apply = apply
        self.original: EngineConfig | None = None  # the engine's config before the study

    def prepare(self, config: EngineConfig) -> EngineConfig:
        """The engine's config as it was before the first trial (the user's `config` is not
        what runs: the engine keeps its model, executor and every knob the study leaves)."""
        if self.original is None:
            self.original = self.live_config()
        return self.original

    def live_config(self) -> EngineConfig:
        """The config the engine runs under now (GET /admin/config); ValueError when it
        cannot be read or does not load here."""
        try:
            status, body = request_json(f"{self.url}/admin/config", self.admin_key)
        except OSError as exc:
            raise ValueError(f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}") from None
        values = body.get("config")
        if status != 200 or not isinstance(values, dict):
            hint = (" (give the engine's admin key: --engine-admin-key or "
                    f"${ENGINE_ADMIN_KEY_ENV})" if status == 401 else "")
            raise ValueError(f"cannot read the engine's config at {self.url}/admin/config: "
                             f"{error_text(body, status)}{hint}")
        try:
            return EngineConfig.from_dict(values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the engine's config at {self.url}/admin/config does not load "
                             f"here: {exc}") from None

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> HttpRun:
        self.reconfigure(config)
        return replay_http(self.url, self.api_key, requests, stop)

    def finish(self, winner: EngineConfig | None) -> None:
        """Call once when the study ends (normally, on an error, on Ctrl-C): the engine on
        `winner` when this runner applies winners and there is one, else back on the config
        it had at `prepare`; ValueError when the engine refuses or cannot be reached."""
        target = winner if self.apply and winner is not None else self.original
        if target is not None:
            self.reconfigure(target)

    def reconfigure(self, config: EngineConfig) -> None:
        values = config.to_dict()
        changes = {k: values[k] for k in self.knobs}
        if not changes:
            return
        try:
            status, body = request_json(f"{self.url}/admin/reconfigure", self.admin_key,
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


class LaunchAborted(Exception):
    """Two launches in a row failed the same way (the same exit status and last log line, or
    never healthy): the command or the machine is at fault, not the knobs, and every further
    trial would fail alike, so the study stops with why. Deliberately not a ValueError: that
    makes one trial infeasible and the study go on."""


def placeholders(argv: Sequence[str]) -> set[str]:
    """The {names} in `argv`; ValueError for a malformed one."""
    names: set[str] = set()
    for arg in argv:
        try:
            names |= {name for _, name, _, _ in string.Formatter().parse(arg) if name is not None}
        except ValueError as exc:
            raise ValueError(f"--command {arg!r}: {exc}") from None
    return names


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
        unknown = sorted(placeholders([arg]) - known)
        if unknown:
            raise ValueError(f"--command has unknown placeholder {{{unknown[0]}}}; use {{port}} "
                             "or an engine knob such as {max_num_seqs}")
    return argv


def fill_template(argv: Sequence[str], config: EngineConfig, port: int) -> list[str]:
    """Each argument with the knobs filled in as YAML scalars (null, true), so `--set K=V`
    reads them back."""
    values = {k: flag_value(v) for k, v in config.to_dict().items()} | {PORT: str(port)}
    return [arg.format(**values) for arg in argv]


@dataclass(frozen=True)
class LaunchCommand:
    """A trial's server command line: the template with its placeholders filled, then the
    engine's host and port flags (unless the template places {port} itself) and the engine's
    flags for the tuned knobs the template does not place."""

    template: tuple[str, ...]
    engine: Engine
    appended: tuple[str, ...]  # tuned knobs given as the engine's flags
    port_flags: bool

    @classmethod
    def of(cls, command: str, engine: Engine, knobs: Sequence[str]) -> LaunchCommand:
        """ValueError for a template that sets a tuned knob or the port as a fixed flag, or a
        tuned knob the engine has no flag for."""
        argv = check_template(command)
        placed = placeholders(argv)
        fixed = [arg for arg in argv if not placeholders([arg])]
        appended = tuple(k for k in knobs if k not in placed)
        engine.check_knobs(appended)
        for knob in appended:
            if engine.sets(fixed, knob):
                raise ValueError(f"--command sets {knob} itself, and the study tunes it: leave "
                                 f"it out (or place it as {{{knob}}})")
        port_flags = PORT not in placed
        if port_flags and sets_flag(fixed, engine.port_flag):
            raise ValueError(f"--command sets {engine.port_flag} itself: leave it out (each "
                             f"server gets a free port) or write {engine.port_flag} {{port}}")
        return cls(tuple(argv), engine, appended, port_flags)

    def argv(self, config: EngineConfig, port: int) -> list[str]:
        argv = fill_template(self.template, config, port)
        if self.port_flags:
            if not sets_flag(self.template, self.engine.host_flag):
                argv += [self.engine.host_flag, LOOPBACK]
            argv += [self.engine.port_flag, str(port)]
        values = config.to_dict()
        return argv + self.engine.flags({k: values[k] for k in self.appended})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


# Kills a launched server's process group once the tuner is gone, however it went (even
# SIGKILL): its stdin is a pipe only the tuner holds, so reading it ends when the tuner dies.
# PR_SET_PDEATHSIG takes the server itself at once, but not what it started (a wrapper
# script's server, an engine's worker processes). Its own session: Ctrl-C never reaches it.
_REAPER = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
group, grace = int(sys.argv[1]), float(sys.argv[2])
sys.stdin.buffer.read()
try:
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        os.killpg(group, 0)
        time.sleep(0.05)
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""
PR_SET_PDEATHSIG = 1


def _dies_with(parent: int) -> Callable[[], None] | None:
    """What the server runs between fork and exec: SIGKILL when its parent (the tuner's
    thread that started it) dies; None where prctl is not there (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    kill = int(signal.SIGKILL)

    def in_child() -> None:  # as little as can be: this runs in the fork of a threaded process
        prctl(PR_SET_PDEATHSIG, kill)
        if os.getppid() != parent:  # the tuner died before the death signal was armed
            os._exit(1)

    return in_child


class LaunchedServer:
    """One server process in a process group of its own, dying with the tuner: stopped with
    its group (SIGTERM, then SIGKILL) by `stop` or on leaving a `with` block, killed at once
    when the tuner dies (PR_SET_PDEATHSIG), its group by a reaper process. Its output is
    drained into a short tail (so it never blocks on a full pipe); `classify` is asked about
    every line, and the first cause it names is kept in `infeasible` as (cause, line)."""

    def __init__(self, argv: Sequence[str],
                 classify: Callable[[str], str | None] | None = None) -> None:
        self.classify = classify
        self.infeasible: tuple[str, str] | None = None
        try:
            self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=_dies_with(os.getpid()))
        except OSError as exc:
            raise ValueError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        self.reaper = _start_reaper(self.proc.pid)
        self.tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            cause = None if self.infeasible or not self.classify else self.classify(line)
            if cause is not None:
                self.infeasible = (cause, line.strip()[:MESSAGE_LINE_CHARS])

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def output(self) -> str:
        self._drained()
        return " | ".join(line for line in self.tail if line) or "(no output)"

    def last_line(self) -> str:
        self._drained()
        return next((line for line in reversed(self.tail) if line.strip()), "")

    def _drained(self) -> None:
        """Once the server has exited, the rest of its output read (a worker it left behind
        may hold the pipe open: not for long)."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE_S)
        self._signal(signal.SIGKILL)  # a server that ignored SIGTERM, workers it left behind
        self.proc.wait()
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait()
            assert self.reaper.stdin is not None
            self.reaper.stdin.close()
        self._reader.join(timeout=1.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _start_reaper(group: int) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(group),
                                 str(STOP_GRACE_S)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None  # the death signal still takes the server itself


@dataclass(frozen=True)
class LaunchFailure:
    """Why a launch got no healthy server: the trial's message, and the cause normalised so
    that the same failure on another trial compares equal (numbers, times and pids out)."""

    message: str
    cause: tuple[object, ...]

    @classmethod
    def exited(cls, server: LaunchedServer) -> LaunchFailure:
        status = server.proc.returncode
        return cls(f"the server exited with status {status}: {server.output()}",
                   ("exited", status, normalized(server.last_line())))

    @classmethod
    def never_healthy(cls, server: LaunchedServer, timeout_s: float) -> LaunchFailure:
        return cls(f"the server never became healthy within {timeout_s:g} s: "
                   f"{server.output()}", ("never healthy", timeout_s))


def normalized(line: str) -> str:
    """`line` with what differs between two runs of one failure (timestamps, pids, addresses,
    sizes) made equal."""
    line = re.sub(r"0x[0-9a-fA-F]+", "0x?", line)
    return " ".join(re.sub(r"\d+", "N", line).split())


class LaunchRunner:
    """A server per trial from a command template with the knobs and a free {port} filled in
    (for an --engine, its flags appended); waits for the engine's health path, replays, and
    always stops it. A launch that fails with one of the engine's start-up failures (out of
    memory) is an infeasible trial; two that fail the same other way in a row stop the study
    (LaunchAborted): a server that exits is noticed at once, one that never becomes healthy
    after `launch_timeout_s`."""

    def __init__(self, command: str, api_key: str | None, launch_timeout_s: float,
                 engine: str = DEFAULT_ENGINE, knobs: Sequence[str] = ()) -> None:
        self.engine = engine_named(engine)
        self.command = LaunchCommand.of(command, self.engine, knobs)
        self.api_key, self.launch_timeout_s = api_key, launch_timeout_s
        self.last_failure: tuple[object, ...] | None = None  # the previous launch's cause

    def prepare(self, config: EngineConfig) -> EngineConfig:
        return config

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> HttpRun:
        port = free_port()
        url = f"http://{LOOPBACK}:{port}"
        with LaunchedServer(self.command.argv(config, port),
                            self.engine.infeasible_cause) as server:
            self._started(server, self._wait_healthy(server, url))
            return replay_http(url, self.api_key, requests, stop)

    def finish(self, winner: EngineConfig | None) -> None:
        """Nothing to put back: every server stopped with its trial."""

    def _started(self, server: LaunchedServer, failure: LaunchFailure | None) -> None:
        """Return when the launch worked; ValueError (the trial is infeasible) or
        LaunchAborted (the study stops) when it did not."""
        if failure is None:
            self.last_failure = None
            return
        if server.infeasible is not None:  # the knobs' fault: another trial may start fine
            self.last_failure = None
            cause, line = server.infeasible
            raise ValueError(f"{cause}: {line}")
        if failure.cause == self.last_failure:
            raise LaunchAborted(f"two launches in a row failed the same way, so the study "
                                f"stopped: {failure.message}")
        self.last_failure = failure.cause
        raise ValueError(failure.message)

    def _wait_healthy(self, server: LaunchedServer, url: str) -> LaunchFailure | None:
        deadline = time.monotonic() + self.launch_timeout_s
        while server.proc.poll() is None:
            try:
                if request_json(f"{url}{self.engine.health_path}", self.api_key,
                                timeout=2.0)[0] == 200:
                    return None
            except OSError:
                pass
            if time.monotonic() >= deadline:
                return LaunchFailure.never_healthy(server, self.launch_timeout_s)
            time.sleep(POLL_S)
        return LaunchFailure.exited(server)
