"""Apply a tune job's winner as a canary: promoted to every replica when it serves live traffic
better, rolled back (every replica on its previous knobs) when it serves it worse; the verdict
rule on its own."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import json
import math
import random
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.canary import (
    MAX_CANARY_WEIGHT,
    REFERENCE,
    TICK_S,
    WORSE,
    Apply,
    ApplyPlan,
    Attempt,
    Served,
    ServedWindow,
    canary_weight,
    judge,
    sequential,
    served_from_row,
    served_row,
    side,
    sprt,
)
from control.openapi import document
from gateway.backends import BackendPool
from protocol.measures import SLO, RequestTiming
from tests.gateway.helpers import start_gateway, streamed_traffic
from tests.support.processes import fairgate_engine
from tests.support.waiting import wait_until

ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
TENANT_SLO = {"slo_ttft_p99_s": 0.25, "slo_tpot_p99_s": 0.1}
ENGINE = ("executor=sim", "sim_clock=realtime", "max_model_len=1024")


def _knobs(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/admin/config", timeout=10) as resp:
        return dict(json.loads(resp.read())["config"])


async def _job(h: Any, max_num_seqs: int) -> str:
    """A sim job whose space holds one max_num_seqs: its best config is that value."""
    spec = {"mode": "sim", "workload": "uniform", "rate": 2, "duration": 4, "trials": 1,
            "robustness": 0, "slo_ttft_p99_s": 30, "slo_tpot_p99_s": 5,
            "set": {"max_num_seqs": max_num_seqs},
            "space": {"max_num_seqs": {"choices": [max_num_seqs]}}}
    resp = await h.client.post("/admin/tune-jobs", json=spec, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    job_id = str((await resp.json())["id"])

    async def done() -> bool:
        job = await (await h.client.get(f"/admin/tune-jobs/{job_id}", headers=ADMIN)).json()
        assert job["state"] in ("queued", "running", "succeeded"), job
        return bool(job["state"] == "succeeded")

    await wait_until(done, 120, f"job {job_id} succeeded", every=0.1)
    return job_id


async def _apply(h: Any, job_id: str, backend: str, min_requests: int = 10) -> dict[str, Any]:
    resp = await h.client.post(f"/admin/tune-jobs/{job_id}/apply", json={
        "backend": backend, "canary_window_s": 2, "min_requests": min_requests}, headers=ADMIN)
    assert resp.status == 202, await resp.text()
    record: dict[str, Any] = {}

    async def ended() -> bool:
        job = await (await h.client.get(f"/admin/tune-jobs/{job_id}", headers=ADMIN)).json()
        record.update(job["apply"])
        return record["state"] in ("promoted", "rolled_back", "failed")

    await wait_until(ended, 120, f"job {job_id}'s apply ended", every=0.1)
    return record


async def test_a_better_config_is_promoted_and_a_worse_one_rolled_back(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    with fairgate_engine(*ENGINE, "max_num_seqs=1") as a, \
            fairgate_engine(*ENGINE, "max_num_seqs=1") as b:
        h = await start_gateway(aiohttp_client, db_url, tenants={"acme": TENANT_SLO}, gateway={
            "backends": [{"url": a}, {"url": b}], "jobs": {"dir": str(tmp_path / "jobs")}})
        good, bad = await _job(h, 16), await _job(h, 1)
        async with streamed_traffic(h, streams=6) as statuses:
            promoted = await _apply(h, good, a)
            assert promoted["state"] == "promoted", promoted["steps"]
            assert [_knobs(u)["max_num_seqs"] for u in (a, b)] == [16, 16]
            verdict = next(s for s in promoted["steps"] if "verdict" in s)
            figures = verdict["figures"]
            assert figures["canary"]["requests"] >= 10 and figures["baseline"]["requests"] >= 10
            assert figures["canary"]["fraction"] >= figures["baseline"]["fraction"]
            # sixteen seats against one, yet the canary was sent at most its quarter (give or
            # take the six streams in flight as the window closed)
            served = figures["canary"]["requests"], figures["baseline"]["requests"]
            assert promoted["canary_weight"] == 0.25
            assert served[0] <= 0.25 * sum(served) + 6, served
            assert promoted["previous"] == {a: {"max_num_seqs": 1}, b: {"max_num_seqs": 1}}

            # a one-seat canary serves about 1/6 of the good requests where 1/4 is even: telling
            # that apart at 95% takes ~100 good requests, which a 2 s window of a loaded
            # machine may not hold (it promoted then): wait for them
            rolled = await _apply(h, bad, a, min_requests=40)
            assert rolled["state"] == "rolled_back", rolled["steps"]
            assert [_knobs(u)["max_num_seqs"] for u in (a, b)] == [16, 16]  # as before it
            verdict = next(s for s in rolled["steps"] if "verdict" in s)
            # one seat against sixteen: the gateway sends it what fits, so it serves far less
            # than an even share of the good requests
            assert verdict["verdict"] == "roll_back" and "capacity" in verdict["step"]
            share = verdict["figures"]["good_share"]
            assert share["low"] and share["share"] < share["even"]
            steps = [s["step"] for s in rolled["steps"]]
            assert any(s.startswith("putting") for s in steps)
        assert statuses and set(statuses) == {200}  # live traffic never failed through it


async def test_apply_refuses_what_it_cannot_do(aiohttp_client: Any, db_url: str,
                                               tmp_path: Path) -> None:
    with fairgate_engine(*ENGINE) as a:
        h = await start_gateway(aiohttp_client, db_url, gateway={
            "backends": [{"url": a}], "jobs": {"dir": str(tmp_path / "jobs")}})
        job = await _job(h, 8)
        for body, param in (({}, "backend"), ({"backend": "http://127.0.0.1:9"}, "backend"),
                            ({"backend": a, "canary_window_s": 0}, "canary_window_s"),
                            ({"backend": a, "min_requests": -1}, "min_requests"),
                            ({"backend": a, "colour": 1}, "colour"),
                            ({"backend": a, "canary_weight": 0}, "canary_weight"),
                            ({"backend": a, "canary_weight": MAX_CANARY_WEIGHT + 0.01},
                             "canary_weight"),
                            ({"backend": a, "canary_weight": "half"}, "canary_weight")):
            resp = await h.client.post(f"/admin/tune-jobs/{job}/apply", json=body,
                                       headers=ADMIN)
            assert resp.status == 400 and (await resp.json())["error"]["param"] == param
        # the document's bound is the one the apply holds to
        weight = document()["components"]["schemas"]["TuneApply"]["properties"]["canary_weight"]
        assert weight["maximum"] == MAX_CANARY_WEIGHT and weight["exclusiveMinimum"] == 0
        missing = await h.client.post("/admin/tune-jobs/job-nope/apply", json={"backend": a},
                                      headers=ADMIN)
        assert missing.status == 404


# ---- the verdict ---------------------------------------------------------------------------------
SLO_ = SLO(0.1, 0.05)


def _served(ttfts: list[float], backend: str = "x", ok: bool = True) -> list[Served]:
    return [Served(float(i), backend, "acme", SLO_, RequestTiming(0.0, [t, t + 0.01], 2,
                                                                   t + 0.01, ok=ok))
            for i, t in enumerate(ttfts)]


def test_judge_promotes_an_equal_canary_and_rolls_back_a_worse_or_unseen_one() -> None:
    fine = _served([0.05] * 90 + [0.2] * 10)
    assert judge(fine, _served([0.05] * 90 + [0.2] * 10), 20)["verdict"] == "promote"
    worse = judge(_served([0.05] * 50 + [0.2] * 50), fine, 20)
    assert worse["verdict"] == "roll_back" and "attainment" in worse["reason"]
    failing = judge(_served([0.05] * 90) + _served([0.05] * 10, ok=False),
                    _served([0.05] * 100), 20)
    assert failing["verdict"] == "roll_back"
    unseen = judge(_served([0.05] * 5), fine, 20)
    assert unseen["verdict"] == "roll_back" and "not enough traffic" in unseen["reason"]


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=40), st.integers(min_value=0, max_value=40))
def test_judge_never_promotes_a_canary_that_misses_far_more(base_misses: int,
                                                           extra: int) -> None:
    """Whatever the baseline misses, a canary missing 30 more of 100 requests is rolled back;
    one missing fewer is promoted."""
    baseline = _served([0.2] * base_misses + [0.05] * (100 - base_misses))
    worse = _served([0.2] * min(100, base_misses + 30 + extra)
                    + [0.05] * max(0, 70 - base_misses - extra))
    better = _served([0.2] * max(0, base_misses - extra) + [0.05] * (100 - max(
        0, base_misses - extra)))
    if base_misses + 30 <= 100:
        assert judge(worse, baseline, 20)["verdict"] == "roll_back"
    assert judge(better, baseline, 20)["verdict"] == "promote"


def test_a_window_keeps_what_each_backend_served() -> None:
    window = ServedWindow(maxlen=3)
    slo = SLO(ttft_s=0.5, itl_s=0.1, target=0.9)
    timings = {b: RequestTiming(0.1 * i, [0.1 * i + 0.01, 0.1 * i + 0.03], 2, 0.1 * i + 0.05,
                                ok=b != "c") for i, b in enumerate("abcd")}
    for backend, timing in timings.items():
        window.record(backend, "acme", slo, timing)
    everything = [served_from_row(row) for row in window.between(0, float("inf"), set("abcd"))]
    assert [s.backend for s in everything] == ["b", "c", "d"]  # the oldest left
    for served in everything:  # read back as recorded
        want, got = timings[served.backend], served.timing
        assert (served.tenant, served.slo) == ("acme", slo)
        assert (got.start, list(got.token_times), got.num_output_tokens, got.end, got.ok) == (
            want.start, list(want.token_times), want.num_output_tokens, want.end, want.ok)
        assert (got.ttft, got.tpot, got.meets(slo)) == (want.ttft, want.tpot, want.meets(slo))
    assert [row[1] for row in window.between(0, float("inf"), {"b", "d"})] == ["b", "d"]
    window.attempt("b", failed=True)
    assert Attempt(*window.attempts_between(0, float("inf"), {"b"})[0]).failed


def test_a_windows_entries_are_left_out_of_the_collectors_walks() -> None:
    """200,000 kept requests walked by every full collection stalled a busy gateway's loop:
    the window keeps rows the collector stops tracking."""
    window = ServedWindow()
    for i in range(50):
        window.record("a", "acme", SLO_, RequestTiming(0.0, [0.01, 0.02], 2, 0.03, ok=i % 3 > 0))
        window.attempt("a", failed=i % 2 == 0)
    # a young collection lets go of a row's inner tuples, the next of the row: both before
    # the rows reach the oldest generation, the one a full collection walks
    gc.collect(0)
    gc.collect(1)
    assert not any(gc.is_tracked(row) for row in window.items)
    assert not any(gc.is_tracked(row) for row in window.attempts)


@pytest.mark.parametrize("burn", [True, False])
def test_a_canary_burning_budget_fast_is_rolled_back(burn: bool) -> None:
    """The others miss nothing; a canary missing 3 of 100 burns 3x its budget: rolled back
    even though 100 requests cannot show the difference with confidence."""
    baseline = _served([0.05] * 100)
    canary = _served([0.2] * (3 if burn else 0) + [0.05] * (97 if burn else 100))
    verdict = judge(canary, baseline, 20)
    assert verdict["verdict"] == ("roll_back" if burn else "promote")
    if burn:
        assert "burns its error budget" in verdict["reason"]


def test_judge_rolls_back_a_canary_that_takes_capacity_away() -> None:
    """Every request it served was good, but it served a fifth of what the other did."""
    verdict = judge(_served([0.05] * 20), _served([0.05] * 100), 10, share=0.5)
    assert verdict["verdict"] == "roll_back" and "capacity" in verdict["reason"]
    assert judge(_served([0.05] * 90), _served([0.05] * 100), 10)["verdict"] == "promote"


async def test_one_engine_is_judged_against_its_own_window_before_the_change() -> None:
    """No other replica: the canary's window after the change against the same engine's
    window before it; worse after, so its knobs go back."""
    window = ServedWindow()
    for i in range(50):  # before the change: all good
        window.items.append(served_row(50.0 + i, "e", "acme", SLO_,
                                       RequestTiming(0.0, [0.05, 0.06], 2, 0.06)))
    for i in range(50):  # after: half miss the TTFT target
        ttft = 0.05 if i % 2 else 0.3
        window.items.append(served_row(100.0 + i, "e", "acme", SLO_,
                                       RequestTiming(0.0, [ttft, ttft + 0.01], 2, ttft + 0.01)))
    clock = itertools.chain([100.0, 100.0], itertools.repeat(160.0))
    calls: list[tuple[str, dict[str, Any]]] = []

    async def switch(name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        calls.append((name, knobs))
        return knobs

    async def persist(record: dict[str, Any]) -> None:
        pass

    async def drain(name: str) -> None:
        pass

    plan = ApplyPlan("job-1", "e", [], {"max_num_seqs": 1}, {"e": {"max_num_seqs": 16}},
                     canary_window_s=30, min_requests=10, max_wait_s=30)
    record = await Apply(plan, window, drain, lambda name: None, switch, persist,
                         clock=lambda: next(clock)).run()
    assert record["state"] == "rolled_back"
    assert calls == [("e", {"max_num_seqs": 1}), ("e", {"max_num_seqs": 16})]
    verdict = next(s for s in record["steps"] if "verdict" in s)
    assert verdict["figures"]["baseline"]["fraction"] == 1.0
    assert verdict["figures"]["canary"]["fraction"] == 0.5


def test_a_sides_figures_keep_tpot_per_request_and_pool_itl_over_gaps() -> None:
    """Nine steady streams and one with a 1 s stall before its last token: every request is
    within its TTFT and TPOT targets (the stall hardly moves a TPOT), but one gap in 40 is over
    the ITL target: the p99 ITL is over the gaps, the p99 TPOT over the requests."""
    slo = SLO(ttft_s=1.0, tpot_s=0.5, itl_s=0.25)
    steady = RequestTiming(0.0, (0.5, 0.625, 0.75, 0.875, 1.0), 5, 1.0)  # gaps of 1/8 s
    stalled = RequestTiming(0.0, (0.5, 0.625, 0.75, 0.875, 1.875), 5, 1.875)
    served = [Served(float(i), "x", "acme", slo, steady) for i in range(9)]
    served.append(Served(9.0, "x", "acme", slo, stalled))
    figures = side(served)
    assert figures["fraction"] == 1.0 and figures["slo_checked"] == 10
    # protocol.stats' nearest rank: numpy's inverted CDF
    assert figures["tpot_p99_s"] == pytest.approx(float(np.percentile(
        [0.125] * 9 + [0.34375], 99, method="inverted_cdf")))
    assert figures["itl_p99_s"] == pytest.approx(float(np.percentile(
        [0.125] * 39 + [1.0], 99, method="inverted_cdf")))
    assert figures["itl_attainment"] == pytest.approx(39 / 40)
    # ITL alone is no request's criterion: such a tenant has no request attainment
    gaps_only = side([Served(0.0, "x", "acme", SLO(itl_s=0.01), steady)])
    assert gaps_only["slo_checked"] == 0 and gaps_only["itl_attainment"] == 0.0


def test_judge_says_so_when_a_side_had_no_slo_to_check() -> None:
    """Tenants without SLOs on the baseline side: no attainment to compare, no crash."""
    no_slo = [Served(float(i), "b", "anon", SLO(), RequestTiming(0.0, [0.05], 1, 0.06))
              for i in range(30)]
    verdict = judge(_served([0.05] * 30), no_slo, 20)
    assert verdict["verdict"] == "promote" and "n/a" in verdict["reason"]


# ---- the sequential test ---------------------------------------------------------------------
LOOSE = SLO(ttft_s=1.0, tpot_s=0.2)  # every simulated request meets it: the window judges share


@dataclasses.dataclass
class Simulated:
    """Seeded traffic around a change at t = 0: before it the canary and a stable replica
    share the requests evenly on the old knobs; after it the canary gets `weight` of them.
    Poisson arrivals, lognormal TTFTs (median 50 ms) and gaps (median 20 ms), 16 tokens; a
    canary attempt that fails is retried on the stable replica, as the gateway does."""

    reference: list[Served]  # the old knobs' last REFERENCE requests
    served: list[Served]  # after the change, in the order they ended
    attempts: list[Attempt]


def simulate(seed: int, *, error: float = 0.0, ttft: float = 1.0, itl: float = 1.0,
             rate: float = 20.0, weight: float = 0.25, window_s: float = 30.0) -> Simulated:
    rng = random.Random(seed)
    served, attempts = [], []
    t = -window_s
    while (t := t + rng.expovariate(rate)) < window_s:
        name = "canary" if rng.random() < (weight if t >= 0 else 0.5) else "stable"
        new = name == "canary" and t >= 0
        if new and rng.random() < error:
            attempts.append(Attempt(t + 0.002, "canary", True))
            name, new = "stable", False
        times = [t + 0.05 * rng.lognormvariate(0, 0.5) * (ttft if new else 1.0)]
        for _ in range(15):
            times.append(times[-1] + 0.02 * rng.lognormvariate(0, 0.3) * (itl if new else 1.0))
        end = times[-1] + 0.001
        if name == "canary" and t < 0 <= end:
            continue  # the canary is drained before the change: its streams end before it
        attempts.append(Attempt(end, name, False))
        served.append(Served(end, name, "acme", LOOSE, RequestTiming(t, times, 16, end)))
    served.sort(key=lambda s: s.at)
    attempts.sort(key=lambda a: a.at)
    return Simulated([s for s in served if s.at < 0][-REFERENCE:],
                     [s for s in served if s.at >= 0], [a for a in attempts if a.at >= 0])


def watch(sim: Simulated, window_s: float = 30.0, min_requests: int = 20) -> dict[str, Any]:
    """What an apply decides over `sim`, looking as `Apply` does: after every failed attempt
    and every TICK_S, the window's judgement at its end. With `at`, when, and `failures` and
    `attempts`, the canary's until then."""
    looks = sorted({TICK_S * i for i in range(1, int(window_s / TICK_S) + 1)}
                   | {a.at for a in sim.attempts if a.failed})
    for now in looks:
        canary = [s for s in sim.served if s.at <= now and s.backend == "canary"]
        tried = [a for a in sim.attempts if a.at <= now and a.backend == "canary"]
        others = [a for a in sim.attempts if a.at <= now and a.backend == "stable"]
        early = sequential(canary, sim.reference, tried, others)
        if early["verdict"] == "roll_back":
            return {**early, "at": now, "failures": sum(a.failed for a in tried),
                    "attempts": len(tried)}
    verdict = judge([s for s in sim.served if s.backend == "canary"],
                    [s for s in sim.served if s.backend == "stable"], min_requests, share=0.25)
    return {**verdict, "at": window_s, "measure": "window"}


def test_sprt_crosses_walds_boundaries() -> None:
    """p0 = 1%, p1 = 21%: each bad outcome adds log 21 = 3.04, each good one
    log(0.79 / 0.99) = -0.23; the boundaries are log(0.95 / 0.001) and log(0.05 / 0.999)."""
    assert round(WORSE, 3) == 6.856
    assert sprt([True] * 3, 0.01)["decision"] == "worse"
    two = sprt([True, True], 0.01)
    assert two["decision"] == "undecided" and two["llr"] == pytest.approx(2 * math.log(21))
    good = sprt([False] * 100, 0.01)
    assert good["decision"] == "not_worse" and good["observations"] == 14
    assert sprt([False] * 13, 0.01)["decision"] == "undecided"
    assert sprt([], 0.01)["p1"] == pytest.approx(0.21)
    assert sprt([], 0.3)["p1"] == pytest.approx(0.6)  # twice p0 once that is more
    assert sprt([], 0.8)["p1"] == pytest.approx(0.9)  # short of 1


@pytest.mark.parametrize("seed", range(20))
def test_a_canary_failing_half_its_attempts_is_rolled_back_after_at_most_5_failures(
        seed: int) -> None:
    verdict = watch(simulate(seed, error=0.5))
    assert verdict["verdict"] == "roll_back" and verdict["measure"] == "errors", verdict
    assert verdict["failures"] <= 5 and verdict["at"] < 5.0, verdict
    errors = verdict["tests"]["errors"]
    assert errors["llr"] >= WORSE and errors["p0"] == 0.01  # the stable replica never failed


@pytest.mark.parametrize("seed", range(20))
def test_a_canary_with_three_times_the_ttft_is_rolled_back_within_its_first_40_requests(
        seed: int) -> None:
    verdict = watch(simulate(seed, ttft=3.0))
    assert verdict["verdict"] == "roll_back" and verdict["measure"] == "ttft_p99", verdict
    assert verdict["attempts"] <= 40, verdict
    assert "first tokens over the old knobs' p99 TTFT" in verdict["reason"]


@pytest.mark.parametrize("seed", range(10))
def test_a_canary_with_three_times_the_gaps_is_rolled_back_on_pooled_itl(seed: int) -> None:
    verdict = watch(simulate(seed, itl=3.0))
    assert verdict["verdict"] == "roll_back" and verdict["measure"] == "itl_p99", verdict
    assert verdict["attempts"] <= 10, verdict


def test_a_canary_as_good_as_the_others_is_promoted_in_20_of_20_runs() -> None:
    verdicts = [watch(simulate(seed)) for seed in range(20)]
    assert [v["verdict"] for v in verdicts] == ["promote"] * 20, [
        v["reason"] for v in verdicts if v["verdict"] != "promote"]


def test_one_slow_step_seen_by_every_stream_is_one_miss() -> None:
    """Eight streams on the canary stall on the same engine step: eight gaps over the p99,
    one burst, no rollback. Eight stalls on eight steps are eight misses: rolled back."""
    reference = simulate(0).reference

    def stalls(apart: float) -> list[Served]:
        return [Served(1.0 + o, "canary", "acme", LOOSE, RequestTiming(
            o, [o + 0.05, o + 0.07, o + 0.57, o + 0.59], 4, o + 0.6))
            for o in (i * apart for i in range(8))]

    together = sequential(stalls(0.0), reference, [], [])
    assert together["verdict"] == "continue", together["tests"]["itl_p99"]
    assert together["tests"]["itl_p99"]["bad"] == 1
    apart = sequential(stalls(0.1), reference, [], [])
    assert apart["verdict"] == "roll_back" and apart["measure"] == "itl_p99"


async def test_an_apply_rolls_a_failing_canary_back_long_before_its_window_ends() -> None:
    """A 60 s window; the canary fails its first three attempts while the other replica
    answers: rolled back at once, the errors test's figures in the verdict, and its share
    limit set before it took requests again and lifted when it went back."""
    window = ServedWindow()
    events: list[tuple[Any, ...]] = []

    async def switch(name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        events.append(("reconfigure", name, knobs))
        return knobs

    async def persist(record: dict[str, Any]) -> None:
        pass

    async def drain(name: str) -> None:
        pass

    plan = ApplyPlan("job-1", "c", ["s"], {"max_num_seqs": 1}, {"c": {"max_num_seqs": 16},
                     "s": {"max_num_seqs": 16}}, canary_window_s=60, min_requests=10,
                     max_wait_s=60, canary_weight=0.2)
    run = Apply(plan, window, drain, lambda name: events.append(("undrain", name)), switch,
                persist, limit_share=lambda name, share: events.append(("share", name, share)))
    task = asyncio.create_task(run.run())

    async def watching() -> bool:
        return run.record["state"] == "canary" and len(run.record["steps"]) == 2

    await wait_until(watching, 10, "the canary is watched")
    for _ in range(10):
        window.attempt("s", failed=False)
    for _ in range(3):
        window.attempt("c", failed=True)
    record = await asyncio.wait_for(task, 10)
    assert record["state"] == "rolled_back" and record["canary_weight"] == 0.2
    verdict = next(s for s in record["steps"] if "verdict" in s)
    assert verdict["verdict"] == "roll_back" and verdict["after_s"] < 5
    assert verdict["figures"]["decided_by"] == "errors"
    errors = verdict["figures"]["sequential"]["errors"]
    assert errors["bad"] == errors["observations"] == 3 and errors["decision"] == "worse"
    assert "3 of 3 attempts failed" in verdict["step"]
    assert events == [("reconfigure", "c", {"max_num_seqs": 1}), ("share", "c", 0.2),
                      ("undrain", "c"), ("reconfigure", "c", {"max_num_seqs": 16}),
                      ("share", "c", None), ("undrain", "c"), ("share", "c", None)]


@pytest.mark.parametrize(("asked", "replicas", "weight"), [
    (None, 2, 0.25), (None, 4, 0.25), (None, 8, 0.125), (0.1, 2, 0.1), (None, 1, 1.0),
    (0.1, 1, 1.0)])
def test_a_canary_gets_an_even_share_at_most_a_quarter_and_a_lone_replica_all(
        asked: float | None, replicas: int, weight: float) -> None:
    assert canary_weight(asked, replicas) == weight


@dataclasses.dataclass
class Replica:
    """Always room, never loaded: the least loaded pick alone would alternate, or pick the
    first."""

    name: str
    model_name: str = "m"
    inflight: int = 0
    healthy: bool = True
    sent: int = 0

    def has_room(self) -> bool:
        return True

    def seats(self) -> int:
        return 8

    def capacity(self) -> int:
        return 8

    def outstanding_tokens(self) -> int:
        return 0

    def dispatched(self, tokens: int) -> None:
        self.sent += 1


@pytest.mark.parametrize("share", [0.25, 0.1])
def test_the_pool_sends_a_canary_at_most_its_share_of_its_models_requests(share: float) -> None:
    canary, stable, other = Replica("c"), Replica("s"), Replica("o", model_name="n")
    pool = BackendPool([canary, stable, other])  # type: ignore[list-item]
    for _ in range(10):  # before the limit: the canary, first and as idle, takes them all
        assert pool.pick(model="m") is canary
        canary.dispatched(1)
    pool.limit_share("c", share)
    picked_by = []
    for _ in range(200):
        picked = pool.pick(model="m")
        assert picked is not None
        picked.dispatched(1)
        picked_by.append(picked.name)
        assert picked_by.count("c") <= share * len(picked_by) + 1
    assert picked_by.count("c") == pytest.approx(share * 200, abs=1)  # and no less
    assert pool.pick(model="n") is other  # another model's replicas are not counted
    pool.limit_share("c", None)
    assert pool.pick(model="m") is canary
