"""Where one command writes a file or a field and the next one reads it, chained as a user
chains them: each test drives the real writer and the real reader, so a field renamed on one
side only fails here.

Held elsewhere, not repeated here:
- capture -> trace loader: tests/gateway/test_capture.py (count, prompt and output tokens,
  max_tokens, tenants, arrival spacing and prefix hashes through `load_trace`; `fairgate tune
  --trace` of a capture), tests/tuner/test_traces.py (write_fairgate_trace <-> load_trace).
- tune -> best.yaml: tests/tuner/test_tune.py::test_sim_study_end_to_end (a real study; its
  best.yaml through `fairgate engine -c`'s loader, max_num_seqs and max_num_batched_tokens).
- calibrate -> profile -> sim: tests/tuner/test_calibrate.py (a real calibration loaded by
  the sim executor; step times follow a saved profile given to EngineConfig),
  tests/engine/test_sim_noise.py and test_sim_wake.py (the profile's noise and wake).
- tenants export -> import: tests/test_tenants_reference.py::
  test_export_round_trips_and_names_only_documented_fields and tests/tenants/test_cli.py::
  test_import_export; nothing added.
- the dashboard page's engine columns against the embedded engine's load:
  tests/test_dashboard_reference.py::test_the_engine_rows_have_the_fields_the_page_names.

Added here: every field of a capture read, its priorities, and what `fairgate bench --trace`
and `fairgate tune --trace` plan from it; best.yaml as the tuner writes it run by `fairgate
engine -c`, `fairgate serve -c` and its own `tuner.flags`, all four knobs; a profile named by
`engine.sim_profile` in a config file, every field of it used; the engine's /load as
RemoteBackend, the dashboard's signs of trouble and the tuner read it; its /stats as the tuner
reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from control.app import make_app as make_serve_app
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.clock import VirtualClock
from engine.executor import ModelOutput
from engine.scheduler import SchedulerOutput
from engine.server import make_app as make_engine_app
from engine.sim import SimExecutor
from engine.sim_profile import (
    FEATURES,
    GIB,
    SimProfile,
    StepNoise,
    Wake,
    load_profile,
    save_profile,
)
from fairgate.cli import build_parser
from fairgate.config import FairgateConfig
from fairgate.engine_cli import build_config, flag_knobs
from fairgate.tune_cli import build_spec, options_from_args, workload_args
from gateway.backends.base import KV_HIGH_WATER, room_from_load
from gateway.backends.embedded import EmbeddedBackend
from gateway.backends.remote import RemoteBackend
from gateway.config import BackendConfig
from gateway.fairqueue import QueuedRequest
from gateway.state import GATEWAY
from tests.gateway.helpers import start_gateway
from tests.support.waiting import wait_for
from tuner.bench_cli import plan_requests
from tuner.loadgen import RunOptions, Target, _Sender
from tuner.outcome import StudyOutcome, TrialRow
from tuner.remote import engine_window, load_counters
from tuner.study_report import ENGINE_COLUMNS, write_outputs
from tuner.traces import TraceRequest, load_trace
from tuner.workload import Limits


def parse(argv: list[str]) -> Any:
    """argv as the `fairgate` command parses it."""
    return build_parser(argv).parse_args(argv)


# ---- 1. gateway.capture -> fairgate bench --trace / fairgate tune --trace ----------------------
CAPTURE_ENGINE = EngineConfig(executor="sim", max_model_len=2048, max_num_seqs=8,
                              max_num_batched_tokens=512)
SENT = [("acme", "interactive"), ("globex", "batch"), ("acme", "batch")]


async def capture(aiohttp_client: Any, tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    """A gateway's capture (prompt text kept) of the requests of SENT, one after another, and
    the usage each client got."""
    path = tmp_path / "captured.jsonl"
    h = await start_gateway(aiohttp_client, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
                            tenants={"acme": {}, "globex": {}}, engine=CAPTURE_ENGINE,
                            gateway={"capture": {"path": str(path), "prompt_text": True}})
    usages = []
    for i, (tenant, priority) in enumerate(SENT):
        resp = await h.post(tenant, {"model": "random:tiny", "prompt": f"question {i} " * (i + 1),
                                     "max_tokens": 3 + i, "priority": priority})
        assert resp.status == 200, await resp.text()
        usages.append((await resp.json())["usage"])
    await h.capture.flush()
    return path, usages


def other_value(value: Any) -> Any:
    """A value of `value`'s JSON type that differs from it."""
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, list):
        return [*value, 12345]
    return value + (1.5 if isinstance(value, float) else 1)


def fields_changed(a: TraceRequest, b: TraceRequest) -> set[str]:
    return {f.name for f in dataclasses.fields(TraceRequest)
            if getattr(a, f.name) != getattr(b, f.name)}


def bench_plan(trace: Path) -> list[TraceRequest]:
    return plan_requests(parse(["bench", "--url", "http://127.0.0.1:9", "--trace", str(trace)]))


def tune_plan(trace: Path) -> list[TraceRequest]:
    options, _ = options_from_args(parse(["tune", "--mode", "sim", "--trace", str(trace),
                                          "--slo-ttft-p99", "1"]))
    return plan_requests(workload_args(options))


async def test_every_field_a_capture_writes_the_trace_loader_reads(aiohttp_client: Any,
                                                                   tmp_path: Path) -> None:
    path, usages = await capture(aiohttp_client, tmp_path)
    header, *lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    trace = load_trace(path)
    assert [(r.tenant, r.priority, r.prompt_tokens, r.output_tokens, r.max_tokens)
            for r in trace] == [(tenant, priority, u["prompt_tokens"], u["completion_tokens"],
                                 3 + i) for i, ((tenant, priority), u)
                                in enumerate(zip(SENT, usages, strict=True))]
    first = records[0]["arrival"]
    assert [r.arrival for r in trace] == pytest.approx([r["arrival"] - first for r in records])

    # each key of the last line, changed alone: the request the loader makes of it changes
    filled: dict[str, set[str]] = {}
    for key, value in records[-1].items():
        changed = tmp_path / f"changed-{key}.jsonl"  # a file each: load_trace caches by mtime
        line = json.dumps({**records[-1], key: other_value(value)})
        changed.write_text("\n".join([header, *lines[:-1], line]) + "\n")
        filled[key] = fields_changed(trace[-1], load_trace(changed)[-1])
    assert [key for key, fields in filled.items() if not fields] == [], "written, never read"
    # and every field the loader fills, the capture writes (the key is the run's, not its)
    unwritten = {f.name for f in dataclasses.fields(TraceRequest)} - set().union(*filled.values())
    assert unwritten == {"api_key"}


async def test_the_captured_prompt_text_is_replayed(aiohttp_client: Any, tmp_path: Path) -> None:
    path, _ = await capture(aiohttp_client, tmp_path)
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    trace = load_trace(path)
    assert [r.prompt for r in trace] == [r["prompt"] for r in records]
    made_up = lambda *_: "made-up"  # noqa: E731
    sender = _Sender(None, Target("http://127.0.0.1:9"), "m", made_up, RunOptions())  # type: ignore[arg-type]
    for planned in bench_plan(path):  # sent as kept: made-up text only where none was kept
        assert json.loads(sender.body(planned, 0))["prompt"] == planned.prompt
    scaled = Limits(scale_tokens=0.5).apply(trace[0])
    assert scaled.prompt is None and json.loads(sender.body(scaled, 0))["prompt"] == "made-up"


async def test_bench_and_tune_plan_a_capture_as_the_requests_it_holds(aiohttp_client: Any,
                                                                      tmp_path: Path) -> None:
    path, _ = await capture(aiohttp_client, tmp_path)
    trace = load_trace(path)
    for planned in bench_plan(path), tune_plan(path):
        assert len(planned) == len(SENT)
        for loaded, sent in zip(trace, planned, strict=True):
            assert fields_changed(loaded, sent) <= {"tenant"}  # the tenant: the test below


async def test_bench_and_tune_keep_a_captures_tenants(aiohttp_client: Any,
                                                      tmp_path: Path) -> None:
    path, _ = await capture(aiohttp_client, tmp_path)
    tenants = [tenant for tenant, _ in SENT]
    assert [r.tenant for r in load_trace(path)] == tenants
    assert [r.tenant for r in bench_plan(path)] == tenants
    assert [r.tenant for r in tune_plan(path)] == tenants


# ---- 2. fairgate tune's best.yaml -> fairgate engine -c / fairgate serve -c -------------------
WINNER = {"max_num_batched_tokens": 768, "max_num_seqs": 24, "max_model_len": 1536,
          "memory_fraction": 0.85}
MEASURES = {"p99_ttft_s": 0.2, "p99_tpot_s": 0.01, "p99_itl_s": 0.01}


def knobs(config: EngineConfig | dict[str, Any]) -> dict[str, Any]:
    values = config if isinstance(config, dict) else config.to_dict()
    return {k: values[k] for k in WINNER}


def write_best_yaml(tmp_path: Path) -> Path:
    """best.yaml as `fairgate tune` writes it, for a study whose trial #1 won with WINNER."""
    options, surface = options_from_args(parse([
        "tune", "--mode", "sim", "--workload", "uniform", "--rate", "10", "--duration", "4",
        "--slo-ttft-p99", "1", "--set", "executor=sim", "--set", "sim_model=tiny",
        "--set", "policy=fair", "--study", "s", "--out", str(tmp_path / "out"),
        "--storage", f"sqlite:///{tmp_path / 's.db'}"]))
    spec = build_spec(options, surface)
    default = TrialRow(0, "COMPLETE", knobs(spec.base), "default", True, MEASURES, 1.0, None)
    winner = TrialRow(1, "COMPLETE", WINNER, None, True, MEASURES, 2.0, None)
    write_outputs(spec, StudyOutcome("s", [default, winner], best=winner, default=default))
    return spec.out_dir / "best.yaml"


async def test_engine_and_serve_run_best_yaml_on_the_recommended_knobs(
        aiohttp_client: Any, tmp_path: Path) -> None:
    best = write_best_yaml(tmp_path)
    # fairgate engine -c best.yaml
    engine = await aiohttp_client(make_engine_app(AsyncEngine(build_config(str(best), []))))
    running = (await (await engine.get("/admin/config")).json())["config"]
    assert knobs(running) == WINNER and running["policy"] == "fair"  # the base's own knobs too
    # fairgate serve -c best.yaml: its embedded engine
    config = FairgateConfig.load(best)
    app = make_serve_app(config.gateway, engine=config.engine,
                         database=f"sqlite+aiosqlite:///{tmp_path / 'serve.db'}",
                         on_demo_key=lambda key: None)
    await aiohttp_client(app)
    (embedded,) = app[GATEWAY].pool.backends
    assert isinstance(embedded, EmbeddedBackend) and knobs(embedded.engine.config) == WINNER
    # best.yaml's `tuner.flags`: the winner as `fairgate engine`'s own command line
    args = parse(["engine", *yaml.safe_load(best.read_text())["tuner"]["flags"]])
    assert knobs(build_config(None, args.overrides, flag_knobs(args))) == WINNER


# ---- 3. fairgate tune calibrate's profile -> engine.sim_profile -> the sim executor ------------
def test_a_profile_named_in_the_config_file_times_the_sim_steps(tmp_path: Path) -> None:
    coefficients = dict.fromkeys(FEATURES, 0.0) | {"step": 1e-3, "tokens": 1e-5,
                                                   "decode_attention": 1e-7}
    profile = SimProfile(coefficients=coefficients,
                         kv_tokens=4096, kv_bytes_per_token=1024, max_position=2048,
                         model="random:tiny", device="cpu", dtype="float32",
                         fit={"r2": 0.99, "steps": 40}, calibration={"max_num_seqs": 8},
                         noise=StepNoise((2.0,), block=1), wake=Wake(0.5, (0.004, 0.002)))
    path = tmp_path / "sim-profile.yaml"
    save_profile(profile, path)  # what `fairgate tune calibrate --out` writes with
    assert load_profile(path) == profile  # every field it writes is read back
    config_file = tmp_path / "fairgate.yaml"
    config_file.write_text(yaml.safe_dump({"engine": {
        "executor": "sim", "sim_profile": str(path), "swap_space_gb": 0.5}}))
    # each step: the fitted sum, times the noise ratio, plus the wake of a fresh engine
    expected = [2 * (1e-3 + 100 * 1e-5) + 0.004, 2 * (1e-3 + 1e-5 + 101 * 1e-7) + 0.002,
                2 * (1e-3 + 1e-5 + 102 * 1e-7)]
    for config in build_config(str(config_file), []), FairgateConfig.load(config_file).engine:
        engine = LLMEngine(config)
        assert engine.config.max_model_len == profile.max_position
        assert engine.capacity.num_blocks == profile.kv_tokens // config.block_size
        assert engine.capacity.num_host_blocks == int(
            0.5 * GIB // (profile.kv_bytes_per_token * config.block_size))
        engine.add_request("a", [1] * 100, SamplingParams(max_tokens=3, ignore_eos=True))
        assert [engine.step().step_time for _ in range(3)] == pytest.approx(expected)


# ---- 5 and 6. the engine's /load and /stats -> the gateway, the dashboard, the tuner ----------
# a KV cache of 6 blocks for 3 seats: four requests of 20 + 30 tokens fill it, one is swapped
# out, and later two run with KV to spare
HELD_ENGINE = EngineConfig(executor="sim", sim_model="tiny", max_model_len=64, num_kv_blocks=6,
                           max_num_batched_tokens=128, max_num_seqs=3, preemption="swap")
PROMPT, OUTPUT, REQUESTS = 20, 30, 4
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}  # start_gateway's admin key


def full_and_swapping(load: dict[str, Any]) -> bool:
    return load["swapped"] > 0 and load["kv_usage"] >= KV_HIGH_WATER


class HeldSim(SimExecutor):
    """The sim executor on a virtual clock; while `held`, each step waits for a permit from
    `allow`, so the test reads the engine between two steps."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, VirtualClock())
        self.held = True
        self.waiting = False
        self.steps = 0
        self._permits = threading.Semaphore(0)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        if self.held:
            self.waiting = True
            assert self._permits.acquire(timeout=10), "the test gave no permit"
            self.waiting = False
        self.steps += 1
        return super().execute(plan)

    def allow(self) -> None:
        self._permits.release()

    def free(self) -> None:
        self.held = False
        self._permits.release()


@dataclasses.dataclass
class Held:
    engine: AsyncEngine
    executor: HeldSim
    url: str
    answers: list[asyncio.Task[Any]]

    async def step_until(self, condition: Callable[[dict[str, Any]], bool]) -> None:
        """One step at a time until `condition(load)` holds; the steps before it are
        published (a step waits for its permit only once the last one's snapshot is out)."""
        for _ in range(100):
            if condition(self.engine.load()):
                return
            await self.step()
        raise AssertionError("the engine never got there")

    async def step(self) -> None:
        """One step, published, with the next one waiting for its permit."""
        target = self.executor.steps + 1
        self.executor.allow()
        await wait_for(lambda: self.executor.steps == target and self.executor.waiting)

    async def finish(self) -> None:
        self.executor.free()
        for task in self.answers:
            assert (await task).status == 200


@contextlib.asynccontextmanager
async def held_engine(aiohttp_client: Any, aiohttp_server: Any) -> AsyncIterator[Held]:
    """A `fairgate engine` server on HeldSim with REQUESTS requests sent straight to it (other
    gateways' work, to a gateway), none of them stepped yet."""
    executor = HeldSim(HELD_ENGINE)
    engine = AsyncEngine.from_engine(LLMEngine(HELD_ENGINE, executor=executor,
                                               clock=executor.clock))
    server = await aiohttp_server(make_engine_app(engine))
    client = await aiohttp_client(server)
    body = {"model": "random:tiny", "prompt": [1] * PROMPT, "max_tokens": OUTPUT,
            "ignore_eos": True}

    def send(i: int) -> asyncio.Task[Any]:
        return asyncio.create_task(client.post("/v1/completions", json={**body, "tenant": f"t{i}"}))

    held = Held(engine, executor, str(server.make_url("/")).rstrip("/"), [send(0)])
    try:
        # the first step holds the first request alone, the others wait for the second: the
        # same steps every run, whenever the requests reach the engine
        await wait_for(lambda: executor.waiting)
        held.answers += [send(i) for i in range(1, REQUESTS)]
        await wait_for(lambda: engine.load()["waiting"] == REQUESTS)
        yield held
    finally:
        executor.free()


async def test_the_gateway_reads_the_engines_load_as_the_engine_means_it(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    async with held_engine(aiohttp_client, aiohttp_server) as held:
        backend = RemoteBackend(BackendConfig(url=held.url), default_max_model_len=4096, slack=0)
        try:
            await backend.refresh()
            assert backend.healthy and backend.seats() == HELD_ENGINE.max_num_seqs
            assert backend.max_model_len == HELD_ENGINE.max_model_len
            assert backend.others == REQUESTS  # held by the engine, none sent by this gateway
            # the engine's outstanding work, in the tokens the gateway's own dispatch adds
            cost = QueuedRequest("t", PROMPT, OUTPUT).cost
            assert backend.outstanding_tokens() == REQUESTS * cost
            assert not room_from_load(backend.load, 0, 0, backend.others)  # 4 >= 3 seats

            await held.step_until(lambda load: load["running"] > 0)  # the first prefilled
            await backend.refresh()
            assert 0 < backend.load["kv_usage"] < KV_HIGH_WATER  # a fraction, not a percent
            assert room_from_load(backend.load, 1, 8, 0)
            assert backend.outstanding_tokens() == (REQUESTS - 1) * cost + OUTPUT - 1

            await held.step_until(full_and_swapping)
            await backend.refresh()
            load = backend.load
            assert min(load["running"], load["waiting"], load["swapped"]) > 0
            assert backend.others == REQUESTS  # running, waiting and swapped all counted
            assert not room_from_load(load, 1, 8, 0)  # seats left, but the KV cache is full

            await held.finish()
            await backend.refresh()
            assert (backend.others, backend.outstanding_tokens()) == (0, 0)
        finally:
            await backend.close()


@contextlib.asynccontextmanager
async def dashboard(aiohttp_client: Any, held: Held,
                    tmp_path: Path) -> AsyncIterator[Callable[[], Awaitable[list[str]]]]:
    """A gateway on the held engine; yields a look at /admin/engines: the signs of trouble
    of the engine's load now (each look is compared with the one before)."""
    h = await start_gateway(aiohttp_client, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
                            gateway={"backends": [{"url": held.url}]})
    backend = h.gateway.pool.primary

    async def signs() -> list[str]:
        await backend.refresh()
        resp = await h.client.get("/admin/engines", headers=ADMIN)
        assert resp.status == 200, await resp.text()
        (row,) = (await resp.json())["engines"]
        return [p["sign"] for p in row["problems"]]

    yield signs


async def test_the_dashboard_reads_the_engines_load(aiohttp_client: Any, aiohttp_server: Any,
                                                    tmp_path: Path) -> None:
    async with (held_engine(aiohttp_client, aiohttp_server) as held,
                dashboard(aiohttp_client, held, tmp_path) as signs):
        await held.step_until(lambda load: load["running"] > 0)
        assert await signs() == ["waiting"]  # requests waiting, the KV cache two thirds free
        await held.step_until(lambda load: load["kv_usage"] >= 0.8)
        assert await signs() == []  # still waiting, for KV this time
        await held.step_until(lambda load: load["num_preemptions"] == 1)
        await signs()  # the look the next one is compared with
        await held.step_until(lambda load: load["num_preemptions"] == 2)
        assert "preempting" in await signs()


async def test_the_dashboard_shows_an_engines_first_preemptions(
        aiohttp_client: Any, aiohttp_server: Any, tmp_path: Path) -> None:
    async with (held_engine(aiohttp_client, aiohttp_server) as held,
                dashboard(aiohttp_client, held, tmp_path) as signs):
        assert await signs() == ["waiting"]
        await held.step_until(full_and_swapping)
        assert await signs() == ["kv_pinned", "preempting"]


async def test_the_tuner_reads_the_engines_load_and_stats(aiohttp_client: Any,
                                                          aiohttp_server: Any) -> None:
    async with held_engine(aiohttp_client, aiohttp_server) as held:
        await held.step_until(full_and_swapping)
        steps, preemptions = await asyncio.to_thread(load_counters, held.url, None)
        assert (steps, preemptions) == (held.executor.steps,
                                        held.engine.llm_engine.scheduler.num_preemptions)
        assert preemptions > 0

        await held.finish()
        window = await asyncio.to_thread(engine_window, held.url, None, 60.0)
        assert window is not None and set(window) == set(ENGINE_COLUMNS)
        stats = held.engine.stats_window(60.0)
        assert window == {"p99_ttft_s": stats["ttft"]["p99"], "p99_tpot_s": stats["tpot"]["p99"],
                          "requests": REQUESTS}
        assert window["p99_ttft_s"] > 0 and window["p99_tpot_s"] > 0
