from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.traces import TraceRequest, write_fairgate_trace
from tuner.workload import (
    WORKLOADS,
    ByteText,
    Lengths,
    Limits,
    LoadShape,
    MixSpec,
    TenantMix,
    TraceReplay,
    WordText,
    arrival_times,
    build_mix,
    build_requests,
    byte_tokens_to_text,
    get_workload,
    load_workload_file,
    parse_workload,
    traces_dir,
)

SHORT = LoadShape(duration=5.0)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_named_workload_builds(name: str) -> None:
    workload = get_workload(name)
    if isinstance(workload, TraceReplay) and not workload.path.exists():
        pytest.skip(f"trace file {workload.path} is not here")
    reqs = build_requests(workload, SHORT)
    assert reqs and all(r.arrival < 5.0 for r in reqs)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in reqs)


def test_unknown_workload_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'.*fixed, uniform, longtail"):
        get_workload("nope")


def test_poisson_and_gamma_keep_the_mean_rate_gamma_is_burstier() -> None:
    rng = np.random.default_rng(1)
    poisson = np.diff(arrival_times(50.0, 20_000, "poisson", 1.0, rng))
    bursty = np.diff(arrival_times(50.0, 20_000, "gamma", 0.2, rng))
    for gaps in (poisson, bursty):
        assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    cv = lambda g: g.std() / g.mean()  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, abs=0.05)
    assert cv(bursty) > 2.0  # shape 0.2: cv = 1/sqrt(0.2) ~ 2.24
    constant = arrival_times(4.0, 5, "constant", 1.0, rng)
    assert constant.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_synthetic_rate_duration_and_count() -> None:
    reqs = build_requests(get_workload("fixed"), LoadShape(rate=100, duration=20, seed=3))
    assert len(reqs) == pytest.approx(2000, rel=0.1)
    assert (
        build_requests(get_workload("fixed"), LoadShape(rate=100, duration=None, num_requests=7))
        != []
    )
    assert len(build_requests(get_workload("fixed"), LoadShape(rate=100, num_requests=7))) == 7


def test_longtail_has_rare_30k_prompts() -> None:
    reqs = build_requests(get_workload("longtail"), LoadShape(rate=1000, duration=10))
    huge = [r for r in reqs if r.prompt_tokens == 30_000]
    assert 0 < len(huge) < len(reqs) * 0.02
    assert np.median([r.prompt_tokens for r in reqs]) == pytest.approx(600, rel=0.2)


def test_shared_prefix_groups_share_text() -> None:
    reqs = build_requests(get_workload("shared-prefix"), SHORT)
    text = ByteText(salt=1)
    by_group: dict[tuple[int, ...], list[str]] = {}
    for i, r in enumerate(reqs):
        by_group.setdefault(r.prefix_hashes, []).append(
            text(r.prompt_tokens, i, r.prefix_hashes, r.block_tokens)
        )
    assert 1 < len(by_group) <= 8
    for prompts in by_group.values():
        assert len({p[:2048] for p in prompts}) == 1  # identical shared prefix
        assert len({p[2048:] for p in prompts}) == len(prompts)  # unique tails
    firsts = {prompts[0][:2048] for prompts in by_group.values()}
    assert len(firsts) == len(by_group)


@settings(deadline=None, max_examples=60)  # a busy CI box must not fail on time
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 10**6),
    blocks=st.lists(st.integers(0, 10**9), max_size=12),
)
def test_byte_text_has_exact_length_and_shared_blocks(n: int, seed: int, blocks: list[int]) -> None:
    text = byte_tokens_to_text(n, seed, blocks, 64)
    assert len(text.encode()) == max(1, n - 1)  # + BOS = n tokens
    other = byte_tokens_to_text(n + 100, seed + 1, blocks, 64)
    shared = min(len(text), 64 * len(blocks))
    assert text[:shared] == other[:shared]


def test_salts_and_seeds_make_different_text() -> None:
    assert ByteText(1)(300, 5) != ByteText(2)(300, 5)
    assert ByteText(1)(300, 5) != ByteText(1)(300, 6)
    assert ByteText(1)(300, 5, (9,)) != ByteText(2)(300, 5, (9,))
    words = WordText(0)(50, 1)
    assert 45 <= len(words.split()) <= 50


@pytest.mark.skipif(not traces_dir().is_dir(), reason="public traces are not here")
def test_trace_speed_rate_slice_and_arrivals() -> None:
    conv = get_workload("azure-code")
    base = build_requests(conv, LoadShape(duration=None, num_requests=200))
    fast = build_requests(conv, LoadShape(duration=None, num_requests=200, speed=4.0))
    assert [r.arrival for r in fast] == pytest.approx([r.arrival / 4 for r in base])
    assert [r.prompt_tokens for r in fast] == [r.prompt_tokens for r in base]
    # A rate override rescales time: the requests sent arrive at the target's mean rate.
    rated = build_requests(conv, LoadShape(rate=20.0, duration=1e9))
    assert len(rated) / rated[-1].arrival == pytest.approx(20.0)
    # ... over the duration asked for, too: R x D requests in D seconds, whatever the rest
    # of the trace's rate is
    window = build_requests(conv, LoadShape(rate=0.6, duration=100.0, start=600.0))
    assert len(window) == 60 and window[-1].arrival == pytest.approx(100.0, rel=1e-6)
    sliced = build_requests(conv, LoadShape(start=600.0, duration=None, num_requests=5))
    assert sliced[0].arrival == 0.0 and sliced[0] != base[0]
    poisson = build_requests(
        conv, LoadShape(rate=50.0, arrivals="poisson", num_requests=100, duration=None)
    )
    assert [r.prompt_tokens for r in poisson] == [r.prompt_tokens for r in base[:100]]
    assert poisson[-1].arrival == pytest.approx(2.0, rel=0.35)


def test_limits_scale_and_cap() -> None:
    r = TraceRequest(0.0, 6758, 500, prefix_hashes=tuple(range(14)), block_tokens=512)
    scaled = Limits(scale_tokens=0.1).apply(r)
    assert (scaled.prompt_tokens, scaled.output_tokens, scaled.block_tokens) == (676, 50, 51)
    assert len(scaled.prefix_hashes) == 14
    capped = Limits(max_prompt_tokens=1000, max_output_tokens=20).apply(r)
    assert (capped.prompt_tokens, capped.output_tokens) == (1000, 20)
    assert capped.prefix_hashes == (0, 1)


def test_mix_shares_keys_and_priorities() -> None:
    spec = MixSpec(
        (
            TenantMix(
                "acme", get_workload("fixed"), api_key="k-acme", priority="interactive", share=0.75
            ),
            TenantMix("batchco", get_workload("uniform"), priority="batch", share=0.25),
            TenantMix("solo", get_workload("fixed"), rate=2.0),
        ),
        LoadShape(rate=40.0, duration=30.0),
    )
    reqs = build_mix(spec)
    counts = {t: sum(r.tenant == t for r in reqs) for t in ("acme", "batchco", "solo")}
    assert counts["acme"] / 30 == pytest.approx(30, rel=0.15)
    assert counts["batchco"] / 30 == pytest.approx(10, rel=0.25)
    assert counts["solo"] / 30 == pytest.approx(2, rel=0.5)
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:], strict=False))
    acme = next(r for r in reqs if r.tenant == "acme")
    assert (acme.api_key, acme.priority) == ("k-acme", "interactive")
    with pytest.raises(ValueError, match="shares need a total rate"):
        build_mix(MixSpec(spec.tenants, LoadShape(duration=5)))


def test_workload_file_yaml_and_json(tmp_path: Path) -> None:
    trace = tmp_path / "mine.jsonl"
    write_fairgate_trace(trace, [TraceRequest(i * 0.1, 50, 5) for i in range(20)])
    (tmp_path / "mix.yaml").write_text(
        "rate: 10\nduration: 4\ntenants:\n"
        "  - {tenant: a, api_key: ka, priority: interactive, share: 0.5, workload: fixed}\n"
        "  - tenant: b\n    share: 0.5\n"
        "    workload: {kind: uniform, prompt_tokens: [10, 20], output_tokens: 3}\n"
        "  - {tenant: c, workload: {trace: mine.jsonl}}\n"
    )
    spec = load_workload_file(tmp_path / "mix.yaml")
    assert spec.shape.rate == 10 and [t.tenant for t in spec.tenants] == ["a", "b", "c"]
    b = spec.tenants[1].workload
    assert b == parse_workload({"kind": "uniform", "prompt_tokens": [10, 20], "output_tokens": 3})
    assert isinstance(spec.tenants[2].workload, TraceReplay)
    reqs = build_mix(spec)
    assert {r.tenant for r in reqs} == {"a", "b", "c"}
    assert all(10 <= r.prompt_tokens <= 20 for r in reqs if r.tenant == "b")
    (tmp_path / "bad.json").write_text(json.dumps({"tenants": [], "speeed": 2}))
    with pytest.raises(ValueError, match=r"bad\.json: unknown workload file setting\(s\): speeed; did you mean speed\?"):
        load_workload_file(tmp_path / "bad.json")
    (tmp_path / "typo.yaml").write_text("rate: fast\ntenants: []\n")
    with pytest.raises(ValueError, match=r"typo\.yaml: rate must be a finite number > 0, got 'fast'"):
        load_workload_file(tmp_path / "typo.yaml")
    (tmp_path / "broken.yaml").write_text("tenants: [\n")
    with pytest.raises(ValueError, match=r"broken\.yaml:2: invalid YAML"):
        load_workload_file(tmp_path / "broken.yaml")
    with pytest.raises(ValueError, match="unknown workload setting.*colour"):
        parse_workload({"kind": "fixed", "colour": "red"})


def test_bad_specs_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="arrivals must be one of"):
        LoadShape(arrivals="weibull")
    with pytest.raises(ValueError, match="rate must be > 0"):
        LoadShape(rate=0)
    with pytest.raises(ValueError, match="low .* <= high"):
        Lengths("uniform", low=10, high=5)
    with pytest.raises(ValueError, match="arrivals 'trace' needs a trace"):
        build_requests(get_workload("fixed"), LoadShape(arrivals="trace"))


def test_burstiness_alone_implies_gamma_arrivals() -> None:
    shape = LoadShape(rate=50.0, burstiness=0.2, num_requests=4000, duration=None)
    gaps = np.diff([r.arrival for r in build_requests(get_workload("fixed"), shape)])
    assert gaps.std() / gaps.mean() > 1.8
