"""A tune-job spec never makes the gateway open a path (issue 25): a sim profile is named from
those the gateway holds (uploaded, or in jobs.dir/sim-profiles), read off the event loop,
capped and of regular files only; whatever path a spec gives is the same prompt 400, and
every field is checked before a job row or folder exists."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from control.app import make_app
from control.jobs import MAX_PROFILE_BYTES, NOT_HELD, PROFILE_FOLDER
from engine.sim_profile import SimProfile, StepNoise, Wake
from gateway.config import GatewayConfig
from tests.gateway.helpers import ServerThread, create_tenants, start_gateway
from tests.support.waiting import wait_until

ADMIN_KEY = "admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
QUICK = {"mode": "sim", "workload": "uniform", "rate": 10, "duration": 4, "trials": 3,
         "holdout": 0, "slo_ttft_p99_s": 0.5, "slo_tpot_p99_s": 0.05}
REFUSED = NOT_HELD.format(field="set")
PROMPT_S = 30.0  # a refusal comes at once; this only bounds a test of a broken gateway


def _profile() -> SimProfile:
    return SimProfile(coefficients={"step": 2e-3, "tokens": 2e-5, "seqs": 1e-4},
                      kv_tokens=400_000, kv_bytes_per_token=1024, max_position=8192,
                      model="random:tiny", device="cpu", dtype="float32",
                      fit={"r2": 0.99, "median_rel_error": 0.03},
                      noise=StepNoise.measured([0.9, 0.95, 1.4, 1.0] * 50, block=32),
                      wake=Wake(0.2, (0.003, 0.0007)))


def _profile_yaml() -> str:
    return yaml.safe_dump(_profile().to_dict(), sort_keys=False)


def _paths(tmp_path: Path) -> dict[str, Path]:
    """A path of every kind a spec might give, outside what the gateway holds."""
    good = tmp_path / "good.yaml"
    good.write_text(_profile_yaml())  # a valid profile: refused all the same (a path)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    link = tmp_path / "link.yaml"
    link.symlink_to(good)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB to read, none on disk
    return {"zero": Path("/dev/zero"), "fifo": fifo, "symlink": link, "directory": folder,
            "missing": tmp_path / "missing.yaml", "huge": huge, "regular": good}


def _jobs(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"jobs": {"dir": str(tmp_path / "jobs"), **extra}}


async def _nothing_made(h: Any, tmp_path: Path) -> None:
    listed = await (await h.client.get("/admin/tune-jobs", headers=ADMIN)).json()
    assert listed["jobs"] == []
    assert not list((tmp_path / "jobs").glob("job-*"))


async def _post(h: Any, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await asyncio.wait_for(h.client.post("/admin/tune-jobs", json=spec, headers=ADMIN),
                                  PROMPT_S)
    return resp.status, await resp.json()


@pytest.mark.parametrize("kind", ["zero", "fifo", "symlink", "directory", "missing", "huge",
                                  "regular"])
async def test_a_path_as_sim_profile_is_a_prompt_400_that_says_it_must_be_named(
        aiohttp_client: Any, db_url: str, tmp_path: Path, kind: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs(tmp_path))
    path = _paths(tmp_path)[kind]
    for spec in ({**QUICK, "set": {"sim_profile": str(path)}},
                 {**QUICK, "set": {"sim_profile": path.name}},  # a name not held
                 {**QUICK, "set": {"sim_profile": f"../{path.name}"}}):
        status, body = await _post(h, spec)
        assert status == 400, body
        # the same words for every path, existing or not: nothing about what it is
        assert body["error"]["message"] == REFUSED and body["error"]["param"] == "set"
    status, body = await _post(h, {**QUICK, "space": {"sim_profile": {"choices": [str(path)]}}})
    assert status == 400 and body["error"]["message"] == NOT_HELD.format(field="space")
    await _nothing_made(h, tmp_path)


async def test_what_is_no_regular_file_in_the_held_folder_is_not_held(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    """A FIFO, a device link, a symlink or a folder put in jobs.dir/sim-profiles under a
    profile's name is no profile: read with O_NONBLOCK and O_NOFOLLOW, it never blocks."""
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs(tmp_path))
    held = tmp_path / "jobs" / PROFILE_FOLDER
    held.mkdir(parents=True)
    paths = _paths(tmp_path)
    os.mkfifo(held / "fifo.yaml")
    (held / "zero.yaml").symlink_to("/dev/zero")
    (held / "link.yaml").symlink_to(paths["regular"])
    (held / "folder.yaml").mkdir()
    for name in ("fifo", "zero", "link", "folder", "missing"):
        status, body = await _post(h, {**QUICK, "set": {"sim_profile": name}})
        assert status == 400 and body["error"]["message"] == REFUSED, (name, body)
    with (held / "big.yaml").open("wb") as f:
        f.truncate(MAX_PROFILE_BYTES + 1)
    status, body = await _post(h, {**QUICK, "set": {"sim_profile": "big"}})
    assert status == 400 and "larger than" in body["error"]["message"]
    (held / "bad.yaml").write_text("coefficients: [1, 2]\n")
    status, body = await _post(h, {**QUICK, "set": {"sim_profile": "bad"}})
    assert status == 400 and "not a valid profile" in body["error"]["message"]
    listed = await (await h.client.get("/admin/sim-profiles", headers=ADMIN)).json()
    assert [p["name"] for p in listed["profiles"]] == ["bad", "big"]  # regular files only
    assert all("error" in p for p in listed["profiles"])
    await _nothing_made(h, tmp_path)


def _call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        **ADMIN, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=PROMPT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _release(fifo: Path) -> None:
    """A reader stuck opening `fifo` (a gateway that opened it) gets a writer and then EOF."""
    with contextlib.suppress(OSError):  # ENXIO: nobody is reading it, as it should be
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_the_gateway_answers_other_requests_while_a_spec_names_a_fifo(
        tmp_path: Path, db_url: str) -> None:
    """The gateway on its own loop and port: while a spec naming a FIFO is being answered,
    another request is answered (a gateway that opened the FIFO on its loop would hang both
    until someone wrote to it)."""
    asyncio.run(create_tenants(db_url, {"acme": {}}))
    fifo = tmp_path / "profile.yaml"
    os.mkfifo(fifo)
    held = tmp_path / "jobs" / PROFILE_FOLDER
    held.mkdir(parents=True)
    os.mkfifo(held / "named.yaml")  # and one under a held name: read in a thread, refused
    config = GatewayConfig.from_dict({"demo_tenant": False, "admin_key": ADMIN_KEY,
                                      "metrics_port": None, **_jobs(tmp_path)})
    with ServerThread(make_app(config, database=db_url)) as gateway:
        answers: list[tuple[int, Any]] = []
        answered = threading.Event()

        def post() -> None:
            for profile in (str(fifo), "named"):
                answers.append(_call(f"{gateway.url}/admin/tune-jobs", "POST",
                                     {**QUICK, "set": {"sim_profile": profile}}))
            answered.set()

        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        try:
            status, health = _call(f"{gateway.url}/healthz")
            assert status == 200 and health == {"status": "ok"}
            assert answered.wait(PROMPT_S), "the spec naming a FIFO was never answered"
        finally:
            for path in (fifo, held / "named.yaml"):
                _release(path)
            poster.join(PROMPT_S)
        assert [s for s, _ in answers] == [400, 400]
        assert {a["error"]["message"] for _, a in answers} == {REFUSED}
        assert _call(f"{gateway.url}/admin/tune-jobs")[1]["jobs"] == []


async def test_an_uploaded_profile_is_named_by_a_job_whose_worker_runs_on_its_file(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs(tmp_path))
    resp = await h.client.put("/admin/sim-profiles/l4-llama8b", data=_profile_yaml(),
                              headers={**ADMIN, "Content-Type": "application/yaml"})
    assert resp.status == 201, await resp.text()
    shown = await resp.json()
    assert (shown["name"], shown["model"], shown["kv_tokens"]) == ("l4-llama8b", "random:tiny",
                                                                    400_000)
    held = tmp_path / "jobs" / PROFILE_FOLDER / "l4-llama8b.yaml"
    assert stat.S_IMODE(held.stat().st_mode) == 0o600
    assert yaml.safe_load(held.read_text()) == _profile().to_dict()
    again = await h.client.put("/admin/sim-profiles/l4-llama8b", json=_profile().to_dict(),
                               headers=ADMIN)  # JSON too; a second PUT replaces it
    assert again.status == 200
    listed = await (await h.client.get("/admin/sim-profiles", headers=ADMIN)).json()
    assert [(p["name"], p["max_position"]) for p in listed["profiles"]] == [("l4-llama8b", 8192)]
    assert listed["profiles"][0]["noise"] == _profile().noise.summary()  # what the sim replays
    assert listed["profiles"][0]["wake"] == {"idle_s": 0.2, "extra_s": [0.003, 0.0007]}

    resp = await h.client.post("/admin/tune-jobs", json={
        **QUICK, "set": {"sim_profile": "l4-llama8b"}}, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    job = await resp.json()
    assert job["spec"]["set"] == {"sim_profile": "l4-llama8b"}  # the row: the name
    folder = tmp_path / "jobs" / job["id"]
    written = json.loads((folder / "spec.json").read_text())
    assert written["set"] == {"sim_profile": str(held.absolute())}  # the worker: its file
    shown = {}

    async def ended() -> bool:
        shown.update(await (await h.client.get(f"/admin/tune-jobs/{job['id']}",
                                               headers=ADMIN)).json())
        return shown["state"] in ("succeeded", "failed")

    await wait_until(ended, 120, "the job ends", every=0.1)
    assert shown["state"] == "succeeded", shown
    best = yaml.safe_load((folder / "best.yaml").read_text())
    assert best["engine"]["sim_profile"] == str(held.absolute())  # the study ran on it


@pytest.mark.parametrize(("name", "body", "status", "param"), [
    (".hidden", _profile_yaml(), 400, "name"),
    ("a b", _profile_yaml(), 400, "name"),
    ("ok", "coefficients: {step: 1e-3", 400, None),  # not YAML
    ("ok", "- 1\n- 2\n", 400, None),
    ("ok", "version: 1\nkv_tokens: 10\n", 400, None),  # lacks fields
    ("ok", _profile_yaml() + "colour: blue\n", 400, "colour"),
    ("ok", _profile_yaml().replace("kv_tokens: 400000", "kv_tokens: -1"), 400, "kv_tokens"),
    ("ok", "x" * (MAX_PROFILE_BYTES + 1), 413, None),
    ("ok", _profile_yaml().replace("block: 32", "block: 0"), 400, "noise"),
    ("ok", _profile_yaml().replace("- 0.9", "- -0.9", 1), 400, "noise"),
    ("ok", _profile_yaml().replace("  block: 32", "  block: 32\n  colour: blue"), 400, "noise"),
    ("ok", _profile_yaml().replace("idle_s: 0.2", "idle_s: 0"), 400, "wake"),
    ("ok", _profile_yaml().replace("- 0.003", "- -0.003"), 400, "wake"),
    ("ok", _profile_yaml().replace("idle_s: 0.2", "idle_s: 0.2\n  colour: blue"), 400, "wake"),
])
async def test_an_upload_that_is_no_profile_is_refused_and_nothing_is_kept(
        aiohttp_client: Any, db_url: str, tmp_path: Path, name: str, body: str, status: int,
        param: str | None) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs(tmp_path))
    resp = await h.client.put(f"/admin/sim-profiles/{name}", data=body,
                              headers={**ADMIN, "Content-Type": "application/yaml"})
    assert resp.status == status, await resp.text()
    assert (await resp.json())["error"]["param"] == param
    assert (await (await h.client.get("/admin/sim-profiles", headers=ADMIN)).json()) == {
        "profiles": []}


async def test_the_sim_profile_endpoints_want_the_admin_key(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway=_jobs(tmp_path))
    tenant = {"Authorization": f"Bearer {h.keys['acme']}"}
    for headers in (tenant, {}):
        assert (await h.client.get("/admin/sim-profiles", headers=headers)).status == 401
        resp = await h.client.put("/admin/sim-profiles/x", data=_profile_yaml(),
                                  headers=headers)
        assert resp.status == 401
    assert not (tmp_path / "jobs" / PROFILE_FOLDER / "x.yaml").exists()


# ---- every field checked before a row or a folder exists ---------------------------------------
@pytest.mark.parametrize(("change", "param"), [
    ({"set": {"sim_model": "llama-9"}}, "set"),
    ({"set": {"model": "/models/llama"}}, "set"),
    ({"space": {"sim_model": {"choices": ["llama-3-8b", "llama-9"]}}}, "space"),
    ({"space": {"max_num_seqs": {"choices": [8, "16"]}}}, "space"),
    ({"space": {"max_num_seqs": {"choices": [8, {"n": 16}]}}}, "space"),
    ({"space": {"memory_fraction": {"choices": [0.8, True]}}}, "space"),
    ({"space": {"policy": {"choices": ["fcfs", "fastest"]}}}, "space"),
    ({"rate": 1000, "duration": 86400}, "rate"),
    ({"rate": None, "duration": 86400}, "duration"),  # uniform's own rate: 10/s
    ({"rate": 10_000, "duration": None}, "rate"),  # the default duration: 60 s
    ({"mode": "replay", "target": "http://127.0.0.1:9", "set": {"sim_profile": "held"}}, "set"),
    ({"workload": None, "captured_minutes": 0}, "captured_minutes"),
    ({"workload": None, "captured_minutes": "5"}, "captured_minutes"),
    ({"workload": None, "captured_minutes": True}, "captured_minutes"),
    ({"workload": None, "captured_minutes": 10**9}, "captured_minutes"),
    ({"captured_minutes": 5}, "workload"),
    ({"workload": None, "captured_minutes": 5}, "captured_minutes"),  # the capture is empty
])
async def test_a_refused_spec_leaves_no_job_row_and_no_folder(
        aiohttp_client: Any, db_url: str, tmp_path: Path, change: dict[str, Any],
        param: str) -> None:
    capture = {"capture": {"path": str(tmp_path / "capture.jsonl")}}
    h = await start_gateway(aiohttp_client, db_url, gateway={**_jobs(tmp_path), **capture})
    held = tmp_path / "jobs" / PROFILE_FOLDER
    held.mkdir(parents=True)
    (held / "held.yaml").write_text(_profile_yaml())
    status, body = await _post(h, {**QUICK, **change})
    assert status == 400 and body["error"]["param"] == param, body
    await _nothing_made(h, tmp_path)
    assert [p.name for p in (tmp_path / "jobs").iterdir()] == [PROFILE_FOLDER]
