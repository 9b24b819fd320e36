"""Tune jobs through the admin API: specs checked field by field, `fairgate tune` run as a
worker process per job with its state in the database, cancel and resume, admin auth on every
endpoint, and a gateway killed mid-job whose job resumes without lost or repeated trials."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from control.jobs import (
    SPEC_FILE,
    parse_spec,
    record_options,
    worker_argv,
    worker_options,
    write_spec_file,
)
from protocol.errors import ApiError
from tenants.jobs import JobRecord
from tests.gateway.helpers import leave_an_apply_mid_canary, start_gateway
from tests.support.processes import drain, free_port, spawn_fairgate
from tests.support.waiting import poll_until, wait_until
from tuner.options import DEFAULT_TRIALS, TuneOptions

ADMIN_KEY = "admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SLOS = {"slo_ttft_p99_s": 0.5, "slo_tpot_p99_s": 0.05}
QUICK = {"mode": "sim", "workload": "uniform", "rate": 10, "duration": 4, "trials": 3,
         "robustness": 0, **SLOS}
TERMINAL = ("succeeded", "failed", "cancelled", "interrupted")


def _jobs_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"jobs": {"dir": str(tmp_path / "jobs"), **extra}}


async def _job(h: Any, job_id: str) -> dict[str, Any]:
    resp = await h.client.get(f"/admin/tune-jobs/{job_id}", headers=ADMIN)
    assert resp.status == 200
    return dict(await resp.json())


async def _until(h: Any, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict[
        str, Any]:
    seen: dict[str, Any] = {}

    async def reached() -> bool:
        seen.update(await _job(h, job_id))
        return seen["state"] in states

    await wait_until(reached, timeout, f"job {job_id} in {states}", every=0.1)
    return seen


async def test_a_sim_job_runs_through_the_admin_api_and_serves_its_outputs(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs_config(tmp_path))
    resp = await h.client.post("/admin/tune-jobs", json=QUICK, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    created = await resp.json()
    assert created["state"] in ("queued", "running")
    assert created["progress"]["trials_planned"] == 3
    job = await _until(h, created["id"], TERMINAL)
    assert job["state"] == "succeeded", job
    assert job["progress"]["trials_done"] == 3 and job["runs"] == 1
    assert [t["number"] for t in job["trials"]] == [0, 1, 2]
    assert job["best"] is not None and job["best"]["feasible"]
    assert {"best.yaml", "report.html", "trials.csv"} <= set(job["links"])
    folder = tmp_path / "jobs" / created["id"]
    written = json.loads((folder / "spec.json").read_text())
    assert written["study"] == created["id"] and written["out"] == str(folder)
    assert written["trials"] == 3 and written["tenant_slos"] is False
    log = await h.client.get(job["links"]["worker.log"], headers=ADMIN)
    assert f"fairgate tune --spec {folder / 'spec.json'}\n" in await log.text()
    best = await h.client.get(job["links"]["best.yaml"], headers=ADMIN)
    assert best.status == 200 and "engine:" in await best.text()
    listed = await (await h.client.get("/admin/tune-jobs", headers=ADMIN)).json()
    assert [j["id"] for j in listed["jobs"]] == [created["id"]]
    missing = await h.client.get(f"/admin/tune-jobs/{created['id']}/files/secrets.txt",
                                 headers=ADMIN)
    assert missing.status == 404


@pytest.mark.parametrize(("change", "param"), [
    ({"mode": "launch"}, "mode"),
    ({"objective": "fastest"}, "objective"),
    ({"workload": "nope"}, "workload"),
    ({"workload": None}, "workload"),
    ({"trials": 0}, "trials"),
    ({"trials": 2.5}, "trials"),
    ({"timeout_s": 60}, "timeout_s"),
    ({"rate": -1}, "rate"),
    ({"slo_ttft_p99_s": "fast"}, "slo_ttft_p99_s"),
    ({"slo_tpot_p99_s": 0}, "slo_tpot_p99_s"),
    ({"slo_itl_p99_s": -1}, "slo_itl_p99_s"),
    ({"slo_ttft_p99_s": None, "slo_tpot_p99_s": None}, "slo_ttft_p99_s"),  # none, nor tenants'
    ({"tenant_slos": False, "slo_ttft_p99_s": None, "slo_tpot_p99_s": None}, "slo_ttft_p99_s"),
    ({"start": -1}, "start"),
    ({"window": 0}, "window"),
    ({"holdout": 17}, "holdout"),
    ({"robustness": -1}, "holdout"),
    ({"holdout_top": 0}, "holdout_top"),
    ({"holdout": 1, "robustness": 2}, "holdout"),
    ({"workers": 2}, "workers"),  # the command line's: not a job's
    ({"trace": "/etc/passwd"}, "trace"),
    ({"study": "other"}, "study"),
    ({"space": "space.yaml"}, "space"),  # a path on the gateway: the mapping itself only
    ({"target": ["http://127.0.0.1:9"], "mode": "replay"}, "target"),
    ({"shadow_requests": 5}, "shadow_requests"),  # for mode shadow
    ({"set": {"max_num_seqs": -4}}, "set"),
    ({"set": {"no_such_knob": 1}}, "set"),
    ({"space": {"max_num_seqs": {"low": 8}}}, "space"),
    ({"target": "http://127.0.0.1:9"}, "target"),
    ({"colour": "blue"}, "colour"),
    ({"captured_minutes": 5}, "workload"),
    ({"trials": 10**400}, "trials"),
    ({"rate": float("inf")}, "rate"),
])
async def test_a_bad_spec_is_a_400_naming_the_field(
        aiohttp_client: Any, db_url: str, tmp_path: Path, change: dict[str, Any],
        param: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs_config(tmp_path))
    resp = await h.client.post("/admin/tune-jobs", json={**QUICK, **change}, headers=ADMIN)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert not (await (await h.client.get("/admin/tune-jobs", headers=ADMIN)).json())["jobs"]
    assert not list((tmp_path / "jobs").glob("*"))  # no folder either (issue 25)


async def test_replay_and_shadow_jobs_need_their_engine(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs_config(tmp_path))
    replay = {**QUICK, "mode": "replay"}
    resp = await h.client.post("/admin/tune-jobs", json=replay, headers=ADMIN)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "target"
    shadow = {k: v for k, v in QUICK.items() if k not in ("workload", "rate", "duration")}
    resp = await h.client.post("/admin/tune-jobs", json={**shadow, "mode": "shadow",
                                                          "shadow": "cand"}, headers=ADMIN)
    body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == "shadow"
    assert "none configured" in body["error"]["message"]
    captured = {**QUICK, "workload": None, "captured_minutes": 5}
    resp = await h.client.post("/admin/tune-jobs", json=captured, headers=ADMIN)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "no_capture"
    assert not list((tmp_path / "jobs").glob("*"))  # refused before its folder was made


async def test_slos_default_to_the_strictest_tenants(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs_config(tmp_path), tenants={
        "acme": {"slo_ttft_p99_s": 0.8, "slo_tpot_p99_s": 0.04, "slo_itl_p99_s": 0.2},
        "globex": {"slo_ttft_p99_s": 0.3, "slo_itl_p99_s": 0.1}})
    spec = {k: v for k, v in QUICK.items() if not k.startswith("slo_")}
    resp = await h.client.post("/admin/tune-jobs", json=spec, headers=ADMIN)
    assert resp.status == 201
    job = await resp.json()
    assert {k: v for k, v in job["spec"].items() if k.startswith("slo_")} == {
        "slo_ttft_p99_s": 0.3, "slo_tpot_p99_s": 0.04, "slo_itl_p99_s": 0.1}


def _worker_options(spec: dict[str, Any], defaults: dict[str, float],
                    tmp_path: Path) -> TuneOptions:
    """What the worker reads: the gateway writes the checked spec to the job's folder and
    starts `fairgate tune` on it; the worker's own parser and from_mapping read it back."""
    from fairgate.cli import build_parser
    from fairgate.tune_cli import options_from_args

    parsed = parse_spec(spec, {"cand": "http://127.0.0.1:9"}, defaults)
    out = tmp_path / "job-000000000001"
    out.mkdir(exist_ok=True)
    write_spec_file(worker_options(parsed.options, out.name, out, False), out / SPEC_FILE)
    record = JobRecord(out.name, parsed.fields, "queued", None, out.name, str(out), None,
                       0, None, None, None, 0.0, None, None, 0.0)
    argv = worker_argv(record, "http://127.0.0.1:8080")
    assert argv[:3] == ["tune", "--spec", str(out / SPEC_FILE)]
    options, _ = options_from_args(build_parser(argv).parse_args(argv))
    assert options == dataclasses.replace(
        parsed.options, study=out.name, out=str(out),
        gateway="http://127.0.0.1:8080" if parsed.options.mode == "shadow" else None)
    return options


def _slos(options: TuneOptions) -> tuple[float | None, float | None, float | None]:
    return options.slo_ttft_p99_s, options.slo_tpot_p99_s, options.slo_itl_p99_s


def test_the_worker_reads_the_spec_the_gateway_checked(tmp_path: Path) -> None:
    """SLOs as `fairgate tune` takes them: any combination, at least one, each one not given
    the strictest tenant's; settled by the gateway, so the worker asks no database."""
    bare = {k: v for k, v in QUICK.items() if not k.startswith("slo_")}
    options = _worker_options(QUICK, {}, tmp_path)
    assert _slos(options) == (0.5, 0.05, None) and not options.tenant_slos
    assert options.trials == 3 and options.holdout == 0 and options.workload == "uniform"
    assert _slos(_worker_options({**bare, "slo_itl_p99_s": 0.2}, {}, tmp_path)) == (
        None, None, 0.2)
    assert _slos(_worker_options({**QUICK, "slo_itl_p99_s": 0.2}, {"slo_itl_p99_s": 0.1},
                                 tmp_path)) == (0.5, 0.05, 0.2)
    assert _slos(_worker_options(bare, {"slo_ttft_p99_s": 1.0, "slo_tpot_p99_s": 0.1,
                                        "slo_itl_p99_s": 0.25}, tmp_path)) == (1.0, 0.1, 0.25)
    assert _slos(_worker_options({**bare, "slo_ttft_p99_s": 1.0, "tenant_slos": False},
                                 {"slo_itl_p99_s": 0.1}, tmp_path)) == (1.0, None, None)
    with pytest.raises(ApiError, match="give at least one SLO") as refused:
        parse_spec(bare, {}, {})
    assert refused.value.param == "slo_ttft_p99_s"
    # the options a job may have beyond the old spec: trace windows, held-out choice
    quick = {k: v for k, v in QUICK.items() if k != "robustness"}  # holdout's older name
    windows = _worker_options({**quick, "start": 5, "window": 30, "holdout": 2,
                               "holdout_top": 4}, {}, tmp_path)
    assert (windows.start, windows.window, windows.holdout, windows.holdout_top) == (
        5.0, 30.0, 2, 4)
    shadow = {k: v for k, v in QUICK.items() if k not in ("workload", "rate", "duration")}
    assert _worker_options({**shadow, "mode": "shadow", "shadow": "cand", "recheck": 1}, {},
                           tmp_path).recheck_count == 1


def test_one_default_for_the_command_line_and_for_a_job() -> None:
    """trials: 30 on both, in one place; the document says the same."""
    from control.jobs import job_spec_schema

    spec = parse_spec({k: v for k, v in QUICK.items() if k != "trials"}, {}, {})
    assert spec.options.trials == TuneOptions().trials == DEFAULT_TRIALS == 30
    assert spec.fields["trials"] == 30
    assert job_spec_schema()["properties"]["trials"]["default"] == 30
    timed = parse_spec({**{k: v for k, v in QUICK.items() if k != "trials"},
                        "timeout_s": 60}, {}, {})
    assert timed.options.trials is None and "trials" not in timed.fields


def test_a_job_queued_before_spec_files_gets_one_from_its_row(tmp_path: Path) -> None:
    """Its row holds the spec as the gateway checked it then (robustness: the older name)."""
    row = {"mode": "sim", "objective": "goodput", "workload": "uniform", "rate": 10.0,
           "duration": 4.0, "trials": 3, "robustness": 0, "slo_ttft_p99_s": 0.5,
           "slo_tpot_p99_s": 0.05, "set": {"max_num_seqs": 8}}
    record = JobRecord("job-000000000002", row, "interrupted", None, "job-000000000002",
                       str(tmp_path), 3, 1, None, None, None, 0.0, None, None, 0.0)
    options = record_options(record)
    assert (options.holdout, options.set, options.study, options.out) == (
        0, {"max_num_seqs": 8}, "job-000000000002", str(tmp_path))
    assert not options.tenant_slos and options.trace is None
    captured = dataclasses.replace(record, spec={**row, "workload": None,
                                                 "captured_minutes": 5})
    assert record_options(captured).trace == str(tmp_path / "trace.jsonl")


async def test_every_jobs_endpoint_wants_the_admin_key(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs_config(tmp_path))
    tenant = {"Authorization": f"Bearer {h.keys['acme']}"}
    calls = [("POST", "/admin/tune-jobs", QUICK), ("GET", "/admin/tune-jobs", None),
             ("GET", "/admin/tune-jobs/job-1", None), ("DELETE", "/admin/tune-jobs/job-1", None),
             ("POST", "/admin/tune-jobs/job-1/resume", None),
             ("POST", "/admin/tune-jobs/job-1/apply", {"backend": "x"}),
             ("GET", "/admin/tune-jobs/job-1/files/best.yaml", None)]
    for method, path, body in calls:
        for headers in (tenant, {}):
            resp = await h.client.request(method, path, json=body, headers=headers)
            assert resp.status == 401, (method, path, headers)
    assert not (await (await h.client.get("/admin/tune-jobs", headers=ADMIN)).json())["jobs"]


async def test_jobs_queue_behind_the_limit_and_cancel(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs_config(tmp_path))
    long = {**QUICK, "duration": 200, "trials": 50}  # runs until cancelled
    first = await (await h.client.post("/admin/tune-jobs", json=long, headers=ADMIN)).json()
    second = await (await h.client.post("/admin/tune-jobs", json=QUICK, headers=ADMIN)).json()
    running = await _until(h, first["id"], ("running",))
    assert running["worker_pid"] is not None
    assert (await _job(h, second["id"]))["state"] == "queued"  # max_running 1
    # the queued one is dropped at once, the running one's worker stopped
    for job in (second, first):
        resp = await h.client.delete(f"/admin/tune-jobs/{job['id']}", headers=ADMIN)
        assert resp.status == 200 and (await resp.json())["state"] == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.kill(running["worker_pid"], 0)
    again = await h.client.delete(f"/admin/tune-jobs/{first['id']}", headers=ADMIN)
    assert again.status == 409
    unknown = await h.client.get("/admin/tune-jobs/job-nope", headers=ADMIN)
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "job_not_found"


async def test_a_job_whose_gateway_is_gone_is_interrupted_and_a_live_ones_is_not(
        tmp_path: Path, db_url: str) -> None:
    """Several gateways on one database: a running job is taken over (interrupted, to be
    resumed) only when its gateway's process is gone or its lease ran out."""
    from control.jobs import LEASE_S, JobManager
    from tenants import TenantStore
    from tenants.jobs import JobStore

    store = TenantStore(db_url)
    await store.init()
    jobs = JobStore(store.db)
    try:
        here = socket.gethostname()
        rows = {"dead": f"{here}:999999999", "elsewhere": "otherhost:1", "stale": "otherhost:2"}
        for name, owner in rows.items():
            await jobs.create(f"job-{name}", {"mode": "sim"}, None, name, str(tmp_path), 1)
            assert await jobs.transition(f"job-{name}", ["queued"], "running", owner=owner)
        await jobs.update("job-stale", updated_at=time.time() - 4 * LEASE_S)
        manager = JobManager(jobs, db_url, tmp_path, 1, None, None)
        await manager._interrupt_orphans()
        states = {j.id: j.state for j in await jobs.jobs()}
        assert states == {"job-dead": "interrupted", "job-elsewhere": "running",
                          "job-stale": "interrupted"}
    finally:
        await store.close()


async def test_an_apply_cut_short_by_a_restart_is_rolled_back_when_the_gateway_starts(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, tmp_path: Path) -> None:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.server import make_app as make_engine_app

    engine = await aiohttp_server(make_engine_app(AsyncEngine(EngineConfig(
        executor="sim", max_model_len=512, max_num_seqs=4))))
    url = str(engine.make_url("")).rstrip("/")
    await leave_an_apply_mid_canary(db_url, str(tmp_path), url)
    import urllib.request as ur

    # the canary already runs the new knobs
    req = ur.Request(f"{url}/admin/reconfigure", data=json.dumps(
        {"changes": {"max_num_seqs": 32}}).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    await asyncio.to_thread(lambda: ur.urlopen(req, timeout=30).read())
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": url}], **_jobs_config(tmp_path)})
    job = await _job(h, "job-cut")
    assert job["apply"]["state"] == "rolled_back", job["apply"]
    assert job["apply"]["switched"] == []
    config = await asyncio.to_thread(lambda: json.loads(ur.urlopen(
        f"{url}/admin/config", timeout=10).read())["config"])
    assert config["max_num_seqs"] == 4


# ---- a gateway killed mid-job ------------------------------------------------------------------
def _call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        **ADMIN, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _serve(config: Path) -> subprocess.Popen[bytes]:
    gateway = spawn_fairgate("serve", "-c", str(config), "--log-level", "WARNING")
    drain(gateway)
    return gateway


_poll = poll_until  # a server process is asked until the condition holds


def test_a_job_interrupted_by_a_killed_gateway_resumes_without_lost_or_repeated_trials(
        tmp_path: Path) -> None:
    db = tmp_path / "gateway.db"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "fairgate.yaml"
    config.write_text(json.dumps({"database": f"sqlite:///{db}", "gateway": {
        "port": port, "admin_key": ADMIN_KEY, "demo_tenant": False, "metrics_port": None,
        "backends": [{"url": "http://127.0.0.1:9"}], "jobs": {"dir": str(tmp_path / "jobs")}}}))
    # 2,000 requests a trial, all of them run (SLOs no config misses: no early stop)
    spec = {**QUICK, "duration": 200, "trials": 5, "heartbeat_s": 1, "slo_ttft_p99_s": 60,
            "slo_tpot_p99_s": 10}
    gateway = _serve(config)
    try:
        _poll(lambda: _call(f"{url}/admin/tune-jobs")[0] == 200, 60, "the gateway answers")
        status, job = _call(f"{url}/admin/tune-jobs", "POST", spec)
        assert status == 201, job
        job_url = f"{url}/admin/tune-jobs/{job['id']}"

        def past_the_first_trials() -> dict[str, Any] | None:
            shown = _call(job_url)[1]
            running = [t["number"] for t in shown["trials"] if t["state"] == "RUNNING"]
            return shown if running and running[0] in (2, 3) else None  # #4 still to run

        shown = _poll(past_the_first_trials, 120, "trial #2 or #3 running")
        worker = shown["worker_pid"]
        gateway.send_signal(signal.SIGKILL)
        gateway.wait()
        storage = f"sqlite:///{db}"
        # the trial the worker was running (none if the kill fell between two trials)
        killed = optuna.load_study(study_name=job["id"], storage=storage).get_trials(
            states=(TrialState.RUNNING,))
        # the worker dies with the gateway: no orphan goes on with the study
        _poll(lambda: not _alive(worker), 10, "the worker gone with the gateway")
        gateway = _serve(config)
        _poll(lambda: _call(f"{url}/admin/tune-jobs")[0] == 200, 60, "the gateway is back")
        shown = _call(job_url)[1]
        assert shown["state"] == "interrupted" and "resume" in shown["error"]
        status, resumed = _call(f"{job_url}/resume", "POST")
        assert status == 200 and resumed["state"] in ("queued", "running")
        finished = _poll(lambda: (j := _call(job_url)[1])["state"] in TERMINAL and j, 300,
                         "the resumed job ends")
        assert finished["state"] == "succeeded", finished
        assert finished["runs"] == 2 and finished["progress"]["trials_done"] == 5
    finally:
        gateway.kill()
        gateway.wait()
    study = optuna.load_study(study_name=job["id"], storage=f"sqlite:///{db}")
    trials = study.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failed = [t for t in trials if t.state == TrialState.FAIL]  # the killed one, once
    assert [t.number for t in failed] == [t.number for t in killed] and len(complete) == 5
    for t in failed:
        (retry,) = [r for r in complete if r.system_attrs.get("failed_trial") == t.number]
        # the same knobs (a kill while its knobs were being drawn left only the first ones)
        assert t.params.items() <= retry.params.items()
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 5  # none repeated


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


# ---- fairgate jobs ------------------------------------------------------------------------------
def test_fairgate_jobs_drives_the_admin_api(tmp_path: Path, db_url: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio as aio

    from control.app import make_app
    from fairgate.cli import main
    from gateway.config import GatewayConfig
    from tests.gateway.helpers import ServerThread, create_tenants

    aio.run(create_tenants(db_url, {"acme": {}}))
    config = GatewayConfig.from_dict({"demo_tenant": False, "admin_key": ADMIN_KEY,
                                      "metrics_port": None, **_jobs_config(tmp_path)})
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(QUICK))
    with ServerThread(make_app(config, database=db_url)) as gateway:
        common = ["--gateway", gateway.url, "--admin-key", ADMIN_KEY]
        assert main(["jobs", "create", "--spec", str(spec), *common]) == 0
        job_id = capsys.readouterr().out.strip()
        assert job_id.startswith("job-")
        _poll(lambda: _call(f"{gateway.url}/admin/tune-jobs/{job_id}")[1]["state"]
              == "succeeded", 120, "the job succeeded")
        assert main(["jobs", "list", *common]) == 0
        out = capsys.readouterr().out
        assert job_id in out and "succeeded" in out and "3/3" in out
        assert main(["jobs", "show", job_id, *common]) == 0
        out = capsys.readouterr().out
        assert "#0" in out and "#2" in out and "best.yaml:" in out
        # a gateway's refusal is one line and status 1; no key says how to give one
        assert main(["jobs", "cancel", job_id, *common]) == 1
        assert "409" in capsys.readouterr().err
        assert main(["jobs", "list", "--gateway", gateway.url, "--admin-key", "wrong-key"]) == 1
        assert "--admin-key" in capsys.readouterr().err
    spec.write_text("{not json")
    assert main(["jobs", "create", "--spec", str(spec), "--gateway", "http://127.0.0.1:9"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["jobs", "list", "--gateway", "http://127.0.0.1:9"]) == 2
    assert "cannot reach" in capsys.readouterr().err


async def test_two_jobs_may_not_tune_one_engine(aiohttp_client: Any, db_url: str,
                                                tmp_path: Path) -> None:
    """Queued (this gateway runs none: max_running 0), a second replay job on the same engine
    is refused, one on another engine is not."""
    h = await start_gateway(aiohttp_client, db_url,
                            gateway=_jobs_config(tmp_path, max_running=0))
    replay = {**QUICK, "mode": "replay", "target": "http://127.0.0.1:8100"}
    first = await h.client.post("/admin/tune-jobs", json=replay, headers=ADMIN)
    assert first.status == 201 and (await first.json())["state"] == "queued"
    again = await h.client.post("/admin/tune-jobs", json={**replay, "target":
                                                         "http://127.0.0.1:8100/v1"},
                                headers=ADMIN)
    body = await again.json()
    assert again.status == 409 and body["error"]["code"] == "engine_busy"
    other = await h.client.post("/admin/tune-jobs", json={**replay, "target":
                                                         "http://127.0.0.1:8101"}, headers=ADMIN)
    assert other.status == 201


async def test_a_study_database_that_cannot_be_opened_is_a_503(tmp_path: Path,
                                                                db_url: str) -> None:
    """The jobs API reads a job's study from the studies' database: when that cannot be opened
    (here a PostgreSQL port nobody listens on), describing the job is a 503 naming why."""
    from control.jobs import JobManager
    from tenants import TenantStore
    from tenants.jobs import JobStore

    store = TenantStore(db_url)
    await store.init()
    jobs = JobStore(store.db)
    try:
        await jobs.create("job-x", {"mode": "sim"}, None, "study-x", str(tmp_path), 1)
        (job,) = await jobs.jobs()
        down = f"postgresql://postgres@127.0.0.1:{free_port()}/fairgate"
        manager = JobManager(jobs, down, tmp_path, 1, None, None)
        with pytest.raises(ApiError) as refused:
            await manager.describe(job)
        assert refused.value.status == 503 and refused.value.code == "database_unavailable"
        assert "the studies' database is unavailable (--storage postgresql://" in str(
            refused.value)
    finally:
        await store.close()
