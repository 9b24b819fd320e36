"""protocol.measures, and the same scripted requests through the engine's /stats, the gateway's
Prometheus metrics and the benchmark report: one definition, one answer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.stats import RequestRecord, StatsRecorder
from gateway.backends import Outcome
from gateway.metrics import GatewayMetrics
from gateway.service import Admission, Gateway
from protocol.measures import SLO, RequestTiming, attainment, goodput, summarize
from tuner.report import Report, RequestResult


@dataclass(frozen=True)
class Scripted:
    start: float
    token_times: tuple[float, ...]
    end: float
    ok: bool = True


SCRIPT = (
    Scripted(0.0, (0.2, 0.25, 0.35, 0.40), 0.40),  # the last token ends the stream
    Scripted(1.0, (1.1, 1.3, 1.5), 1.6),  # finish event and [DONE] 0.1 s after the last token
    Scripted(2.0, (2.3,), 2.35),  # one token: no gap, no TPOT
    Scripted(3.0, (3.1, 3.2), 3.5, ok=False),  # failed: in no latency, a miss for every SLO
)
TTFTS = [0.2, 0.1, 0.3]
ITLS = [0.05, 0.1, 0.05, 0.2, 0.2]
TPOTS = [0.2 / 3, 0.2]
# TTFT and TPOT: met by the first only (the second is slow per token); ITL: 3 of the 5 gaps of
# the requests that succeeded (the first's), 3 of 7 with the failed one's (its gap and one more)
TARGETS = SLO(ttft_s=0.25, tpot_s=0.07, itl_s=0.1)


def through_engine() -> dict[str, tuple[int, float]]:
    stats = StatsRecorder(start_time=0.0)
    for i, s in enumerate(SCRIPT):
        stats.add(RequestRecord(f"r{i}", "acme", "interactive", "stop" if s.ok else "abort",
                                s.start, s.end, s.start, s.token_times[0], s.token_times, 5,
                                len(s.token_times)))
    out = stats.window(now=10.0, window_s=100.0, slo_ttft=TARGETS.ttft_s,
                       slo_tpot=TARGETS.tpot_s, slo_itl=TARGETS.itl_s)
    assert out["goodput"]["requests"] == 1
    assert out["itl_attainment"] == {"slo_itl": 0.1, "gaps": 5, "met": 3, "fraction": 0.6}
    return {m: (out[m]["count"], out[m]["mean"]) for m in ("ttft", "itl", "tpot")}


def through_gateway() -> tuple[dict[str, tuple[int, float]], GatewayMetrics]:
    metrics = GatewayMetrics()
    seen: list[RequestTiming] = []  # what `_observe` measured TPOT from (no histogram has it)
    observe_stream = metrics.observe_stream

    def spy(tenant: str, timing: RequestTiming, slo: SLO) -> None:
        seen.append(timing)
        observe_stream(tenant, timing, slo)

    metrics.observe_stream = spy  # type: ignore[method-assign]
    tenant = SimpleNamespace(name="acme", slo=TARGETS)
    for s in SCRIPT:
        outcome = Outcome(prompt_tokens=5, completion_tokens=len(s.token_times),
                          chunk_times=list(s.token_times))
        adm = SimpleNamespace(tenant=tenant, outcome=outcome, arrival=s.start, dispatched_at=None,
                              item=SimpleNamespace(state="done"),
                              job=SimpleNamespace(req=SimpleNamespace(stream=True)))
        # the method itself, on a stand-in gateway: it only needs the metrics
        status = 200 if s.ok else 502
        Gateway._observe(SimpleNamespace(metrics=metrics), adm, status, True,
                         Admission.timing(adm, status))  # type: ignore[arg-type]

    def read(metric: str) -> tuple[int, float]:
        name, labels = f"fairgate_gateway_{metric}_seconds", {"tenant": "acme"}
        count = metrics.registry.get_sample_value(f"{name}_count", labels)
        total = metrics.registry.get_sample_value(f"{name}_sum", labels)
        assert count is not None and total is not None
        return int(count), total / count

    tpots = [tpot for t in seen if t.ok and (tpot := t.tpot) is not None]
    return {"ttft": read("ttft"), "itl": read("itl"),
            "tpot": (len(tpots), sum(tpots) / len(tpots))}, metrics


def through_report() -> dict[str, tuple[int, float]]:
    results = []
    for i, s in enumerate(SCRIPT):
        times = s.token_times
        results.append(RequestResult(
            i, "acme", None, s.start, start=s.start, status="ok" if s.ok else "stream error",
            prompt_tokens=5, output_tokens=len(times), ttft=times[0] - s.start,
            e2e=s.end - s.start, itl=[b - a for a, b in zip(times, times[1:], strict=False)]))
    report = Report(results, duration=4.0, slo_ttft=TARGETS.ttft_s, slo_tpot=TARGETS.tpot_s,
                    slo_itl=TARGETS.itl_s)
    assert report.total.goodput == pytest.approx(1 / 4.0)
    # ITL per gap, as the gateway counts it: 3 of the successes' 5, the failed one's 2 missed
    assert report.total.itl_attainment == {"gaps": 7, "met": 3, "fraction": pytest.approx(3 / 7)}
    rows = [row for row in report.to_json()["requests"] if row["status"] == "ok"]
    counts = {"ttft": sum(r["ttft_s"] is not None for r in rows),
              "tpot": sum(r["tpot_s"] is not None for r in rows),
              "itl": sum(len(r["itl_s"]) for r in rows)}
    t = report.total
    means = {"ttft": t.ttft["mean_ms"], "itl": t.itl["mean_ms"], "tpot": t.tpot["mean_ms"]}
    return {m: (counts[m], means[m] / 1000) for m in counts}


def test_one_answer_from_engine_gateway_and_report() -> None:
    expected = {"ttft": (3, sum(TTFTS) / 3), "itl": (5, sum(ITLS) / 5),
                "tpot": (2, sum(TPOTS) / 2)}
    gateway, metrics = through_gateway()
    surfaces = {"engine": through_engine(), "gateway": gateway, "report": through_report()}
    for surface, measured in surfaces.items():
        for measure, (count, mean) in expected.items():
            assert measured[measure][0] == count, (surface, measure)
            assert measured[measure][1] == pytest.approx(mean), (surface, measure)
    # the gateway's SLO counters: TTFT met by the first two; TPOT by the first and the
    # one-token request; the failed one misses both
    read = metrics.registry.get_sample_value
    for slo in ("ttft", "tpot"):
        for met, n in (("true", 2), ("false", 2)):
            labels = {"tenant": "acme", "slo": slo, "met": met}
            assert read("fairgate_gateway_slo_requests_total", labels) == n
        assert read("fairgate_gateway_slo_attainment", {"tenant": "acme", "slo": slo}) == 0.5
    # ITL, per gap: 3 of the successes' 5 gaps, and the failed one's gap and its end missed
    assert read("fairgate_gateway_slo_requests_total",
                {"tenant": "acme", "slo": "itl", "met": "true"}) is None
    assert read("fairgate_gateway_slo_gaps_total", {"tenant": "acme", "met": "true"}) == 3
    assert read("fairgate_gateway_slo_gaps_total", {"tenant": "acme", "met": "false"}) == 4
    assert read("fairgate_gateway_slo_attainment",
                {"tenant": "acme", "slo": "itl"}) == pytest.approx(3 / 7)
    assert read("fairgate_gateway_tpot_seconds_count", {"tenant": "acme"}) == len(TPOTS)


def test_engine_and_report_percentiles_agree() -> None:
    stats = StatsRecorder(start_time=0.0)
    for i, s in enumerate(SCRIPT):
        stats.add(RequestRecord(f"r{i}", "acme", "interactive", "stop" if s.ok else "abort",
                                s.start, s.end, None, s.token_times[0], s.token_times, 5,
                                len(s.token_times)))
    engine = stats.window(now=10.0, window_s=100.0)["itl"]
    report = Report([RequestResult(0, "acme", None, 0.0, ttft=0.1, e2e=1.0, output_tokens=6,
                                   itl=ITLS)], duration=1.0).total.itl
    for ms_key, key in (("median_ms", "p50"), ("p90_ms", "p90"), ("p99_ms", "p99")):
        assert report[ms_key] == pytest.approx(engine[key] * 1000)


# ---------------------------------------------------------------------------- the definitions


def test_request_timing() -> None:
    t = RequestTiming(start=0.0, token_times=(0.2, 0.25, 0.35, 0.40), num_output_tokens=4,
                      end=0.45)
    assert t.ttft == pytest.approx(0.2)
    assert list(t.itls) == pytest.approx([0.05, 0.1, 0.05])
    assert t.tpot == pytest.approx(0.2 / 3)  # to the last token, not to the end
    assert t.e2e == pytest.approx(0.45)
    one = RequestTiming(0.0, (0.3,), 1, 0.3)
    assert one.tpot is None and list(one.itls) == []
    none = RequestTiming(0.0, (), 0, 1.0)
    assert none.ttft is None and none.tpot is None
    # several tokens in one chunk: TPOT divides by tokens, not by chunks
    assert RequestTiming(0.0, (0.1, 0.5), 5, 0.5).tpot == pytest.approx(0.1)


def test_meets_with_unset_and_set_targets() -> None:
    fast = RequestTiming(0.0, (0.1, 0.2), 2, 0.2)
    slow_start = RequestTiming(0.0, (2.0, 2.1), 2, 2.1)
    no_token = RequestTiming(0.0, (), 0, 1.0)
    one_token = RequestTiming(0.0, (0.1,), 1, 0.1)
    failed = RequestTiming(0.0, (0.1, 0.2), 2, 0.2, ok=False)
    unset = SLO()
    assert fast.meets(unset) and slow_start.meets(unset) and no_token.meets(unset)
    assert not failed.meets(unset)  # a failed request is a miss, whatever the targets
    assert not slow_start.meets(SLO(ttft_s=1.0))
    assert slow_start.meets(SLO(tpot_s=0.2))  # only the TPOT target is set
    assert not no_token.meets(SLO(ttft_s=1.0))  # no first token: misses a TTFT target
    assert one_token.meets(SLO(tpot_s=0.001))  # no TPOT to miss
    assert not fast.meets(SLO(tpot_s=0.05))
    assert fast.meets(SLO(ttft_s=0.1, tpot_s=0.1))  # at the target meets it
    # ITL is pooled over gaps: never a request's criterion
    assert fast.meets(SLO(itl_s=0.001)) and fast.meets_tpot(SLO(itl_s=0.001))
    assert SLO(1.0, 0.1) == SLO(ttft_s=1.0, tpot_s=0.1)  # positional: (TTFT, TPOT, ITL)
    assert SLO().unset and not SLO(itl_s=0.1).unset and not SLO(tpot_s=0.1).unset


def test_gaps_within_counts_a_requests_part_of_the_pooled_itl() -> None:
    t = RequestTiming(0.0, (0.25, 0.3125, 0.4375, 0.5), 4, 0.5)  # gaps 1/16, 1/8, 1/16: exact
    assert t.gaps_within(SLO(itl_s=0.0625)) == (2, 3)
    assert t.gaps_within(SLO(itl_s=0.125)) == (3, 3)  # at the target meets it
    assert t.gaps_within(SLO(itl_s=0.01)) == (0, 3)
    assert t.gaps_within(SLO()) == (3, 3)  # no ITL target: every gap is within it
    assert t.gaps_within(SLO(ttft_s=0.01, tpot_s=0.01, itl_s=1.0)) == (3, 3)  # ITL's alone
    # several tokens in one chunk: gaps are between the times seen, not per token
    assert RequestTiming(0.0, (0.1, 0.5), 5, 0.5).gaps_within(SLO(itl_s=0.2)) == (0, 1)
    assert RequestTiming(0.0, (0.3,), 1, 0.3).gaps_within(SLO(itl_s=0.1)) == (0, 0)
    # a failed or turned-away request misses every gap it had and one for its missing end
    failed = RequestTiming(0.0, (0.1, 0.2, 0.3), 3, 0.3, ok=False)
    assert failed.gaps_within(SLO(itl_s=1.0)) == (0, 3)
    assert RequestTiming(0.0, (), 0, 0.0, ok=False).gaps_within(SLO(itl_s=1.0)) == (0, 1)
    # pooled, the p99 rule: 99 of 100 gaps within is "p99 ITL <= X" met, 98 is not
    stalled = RequestTiming(0.0, (*[0.5 * i for i in range(100)], 51.5), 101, 51.5)
    met, gaps = stalled.gaps_within(SLO(itl_s=0.5))  # 99 gaps of 0.5 s, one of 2 s
    assert (met, gaps) == (99, 100) and attainment(met, gaps)["burn_rate"] == pytest.approx(1.0)
    assert stalled.meets(SLO(tpot_s=0.52))  # TPOT hardly sees the stall: 51.5 s / 100


def test_summarize() -> None:
    assert summarize([]) == {"count": 0, "mean": None, "max": None, "p50": None, "p90": None,
                             "p95": None, "p99": None}
    s = summarize(iter([3.0, 1.0, 2.0]))  # any iterable, unsorted
    assert s["count"] == 3 and s["mean"] == 2.0 and s["max"] == 3.0 and s["p50"] == 2.0
    assert list(s) == ["count", "mean", "max", "p50", "p90", "p95", "p99"]


def test_goodput() -> None:
    timings = [RequestTiming(0.0, (0.1, 0.2), 2, 0.2), RequestTiming(0.0, (0.9, 1.0), 3, 1.0),
               RequestTiming(0.0, (0.1,), 1, 0.1, ok=False)]
    g = goodput(timings, 2.0, SLO(ttft_s=0.5))
    assert (g.requests, g.requests_per_s, g.output_tokens_per_s) == (1, 0.5, 1.0)
    assert g.fraction == pytest.approx(1 / 3)
    assert goodput([], 0.0, SLO()).fraction is None


def test_attainment_and_burn_rate() -> None:
    a = attainment(met=98, total=100, target=0.99)  # 2% missed of a 1% budget
    assert a["fraction"] == 0.98 and a["budget"] == pytest.approx(0.01)
    assert a["burn_rate"] == pytest.approx(2.0)
    assert attainment(100, 100)["burn_rate"] == 0.0
    assert attainment(0, 0) == {"fraction": None, "target": 0.99, "budget": pytest.approx(0.01),
                                "burn_rate": None}
    # failures and rejections count as misses: they belong in `total`
    timings = [RequestTiming(0.0, (0.1,), 1, 0.1)] * 9 + [RequestTiming(0.0, (), 0, 0.0, ok=False)]
    slo = SLO(ttft_s=1.0, target=0.95)
    met = sum(t.meets(slo) for t in timings)
    assert attainment(met, len(timings), slo.target)["burn_rate"] == pytest.approx(0.1 / 0.05)
    with pytest.raises(ValueError, match="between 0 and 1"):
        SLO(target=1.0)
    with pytest.raises(ValueError, match="met"):
        attainment(3, 2)


@given(st.floats(-1e3, 1e3), st.lists(st.floats(0, 10), min_size=1, max_size=30),
       st.integers(0, 5))
def test_tpot_and_gaps_span_first_to_last_token(start: float, gaps: list[float],
                                                 extra_tokens: int) -> None:
    times = [start + gaps[0]]
    for gap in gaps[1:]:
        times.append(times[-1] + gap)
    n = len(times) + extra_tokens  # a chunk may carry several tokens
    t = RequestTiming(start, times, n, times[-1] + 1.0)
    span = times[-1] - times[0]
    assert math.isclose(sum(t.itls), span, rel_tol=1e-9, abs_tol=1e-9)
    assert t.ttft is not None and math.isclose(t.ttft + sum(t.itls), times[-1] - start,
                                               rel_tol=1e-9, abs_tol=1e-9)
    if n < 2:
        assert t.tpot is None
    else:
        assert t.tpot is not None and math.isclose(t.tpot * (n - 1), span, rel_tol=1e-9,
                                                   abs_tol=1e-9)
    assert t.meets(SLO()) and t.meets(SLO(ttft_s=t.ttft, tpot_s=t.tpot))
    assert t.gaps_within(SLO(itl_s=max(t.itls, default=0.0))) == (len(gaps) - 1,
                                                                  len(gaps) - 1)
