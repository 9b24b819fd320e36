"""The schedule of recorded scenarios, pinned step by step.

Each scenario drives LLMEngine on the sim executor (virtual clock) through a seeded random mix of
arrivals, aborts and steps, and records every step: which requests ran, from which position, how
many tokens, whether they sampled, their block tables, who was preempted, the swap copies and who
finished why. The digests below were recorded with the scheduler before its issue-28
optimisations, so a faster scheduler must pick exactly the same work, block for block; those
with batch work admitted and put back in one step were recorded again on 2026-12-07, when that
stopped being a preemption (Scheduler._unadmit: no swap, no preempted entry).

When a digest changes on purpose (a scheduling rule changed), rerun with
FAIRGATE_PRINT_SCHEDULE_DIGESTS=1 and paste the printed digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Any

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import POLICIES

# scenario name -> (engine knobs, arrival-mix knobs)
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    **{f"{policy}-{preemption}": (
        dict(policy=policy, preemption=preemption, num_kv_blocks=48, block_size=8,
             max_num_seqs=12, max_num_batched_tokens=96, max_model_len=256,
             swap_space_gb=1.0, long_prefill_token_threshold=40, max_num_partial_prefills=2),
        dict(requests=70, steps=260, prompt=(4, 120), output=(1, 60)))
       for policy in POLICIES for preemption in ("recompute", "swap")},
    "fair-weighted-no-prefix-cache": (
        dict(policy="fair", enable_prefix_caching=False, num_kv_blocks=64, block_size=16,
             max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512),
        dict(requests=80, steps=300, prompt=(4, 200), output=(1, 40), weights=True)),
    "tiny-swap-space-falls-back": (
        dict(policy="priority", preemption="swap", swap_space_gb=1e-5, num_kv_blocks=32,
             block_size=4, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=128),
        dict(requests=50, steps=250, prompt=(2, 60), output=(1, 50))),
    "many-decodes": (  # the benchmark's shape, smaller: block boundaries, shared prefixes
        dict(policy="fcfs", num_kv_blocks=2048, block_size=16, max_num_seqs=96,
             max_num_batched_tokens=1024, max_model_len=4096),
        dict(requests=200, steps=200, prompt=(16, 160), output=(20, 400))),
}

DIGESTS = {
    "fcfs-recompute": "0d32bf38fb19077662fd89402bf506158ffeae20d31b0824bc5fd7c7b90b5fae",
    "fcfs-swap": "ba3622eeed8d456c39bad35125d854b652b99bea6a4d2281ff77b02f208c0240",
    "priority-recompute": "ebd3766df8b3bdd97f0ae5936015215245923fe8cbc410cef4131bfce1ef954f",
    "priority-swap": "0d6e5193968c8db34c431dcf293a3eca5026e893a335bc27e306c3cac2d4a056",
    "sjf-recompute": "c631367ab74aca648e734ec4db4b8514552531e41f40c4339ed04c83f8a4e638",
    "sjf-swap": "6c9b32c6d4ec9259d4971d53c65d4be766f2bd259bdcfbb8135c78c7bef072d7",
    "prefix-recompute": "990f11aebcf6df929481346a79638b39ebd72d79a5efb8670990f7f221199fa3",
    "prefix-swap": "2659098483e91404d3d18a86503228cde36f72d480992d5c7b4d1941e65858c5",
    "fair-recompute": "832d174ea558f7ca80f63f340eac41332014e96c662d61cb9053e39d25318ab3",
    "fair-swap": "fc61c04d8c84c43b7e5e04ced1ba21fee8975252e6ff8ea482c88422940153f2",
    "fair-weighted-no-prefix-cache": "daea1044ca416b458f8d09aef04cb6ff5d7ff2fbb601447859b27601bf583db5",
    "tiny-swap-space-falls-back": "a1d6522c91261a8f871372f9eaa56e925ff3c17000729655ad091765bf4ecee4",
    "many-decodes": "27e9f61bc9208209784f42ee4ac2b21816e36477639c087bb444b16f20e762d0",
}


def run_scenario(knobs: dict[str, Any], mix: dict[str, Any]) -> list[Any]:
    """Every step's plan and results, as plain JSON values."""
    engine = LLMEngine(EngineConfig(executor="sim", sim_model="tiny", **knobs))
    rng = random.Random(28)
    trace: list[Any] = []
    added = 0
    if mix.get("weights"):
        engine.scheduler.waiting.weights.update({"t0": 1.0, "t1": 2.0, "t2": 0.5})
    for step_index in range(mix["steps"] * 20):
        if step_index >= mix["steps"] and not engine.has_unfinished():
            break  # arrivals over and everything drained
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4]) if step_index < mix["steps"] else 0):
            if added == mix["requests"]:
                break
            prompt_len = rng.randint(*mix["prompt"])
            prefix = [rng.randint(1, 3)] * rng.choice([0, 8, 16, 32])
            prompt = (prefix + [rng.randint(1, 200) for _ in range(prompt_len)])
            prompt = prompt[:knobs["max_model_len"] - 1]
            max_tokens = min(rng.randint(*mix["output"]), knobs["max_model_len"] - len(prompt))
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7,
                                    stop_token_ids=tuple(rng.sample(range(1, 256), 2)),
                                    min_tokens=min(max_tokens, rng.randint(0, 3)))
            engine.add_request(f"r{added}", prompt, params, tenant=f"t{rng.randint(0, 2)}",
                               priority=rng.choice(["interactive", "batch"]))
            added += 1
        if added and step_index < mix["steps"] and rng.random() < 0.05:
            engine.abort(f"r{rng.randrange(added)}")
        scheduler = engine.scheduler
        plan = scheduler.schedule()
        step = {
            "run": [[s.request.request_id, s.start, s.num_tokens, s.samples,
                     list(s.request.block_ids)] for s in plan.requests],
            "preempted": plan.preempted, "swap_out": plan.swap_out, "swap_in": plan.swap_in,
        }
        result = scheduler.update(plan, engine.executor.execute(plan).sampled)
        step["finished"] = sorted(result.finished.items())
        # as lists, the shape the pinned digests were taken with
        step["outputs"] = sorted((rid, [token]) for rid, token in result.sampled.items())
        scheduler.check_invariants()
        trace.append(step)
    assert not engine.has_unfinished()
    trace.append(engine.stats())
    return trace


def digest(trace: list[Any]) -> str:
    return hashlib.sha256(json.dumps(trace, sort_keys=True, default=str).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_recorded_schedule_is_unchanged(name: str) -> None:
    trace = run_scenario(*SCENARIOS[name])
    if os.environ.get("FAIRGATE_PRINT_SCHEDULE_DIGESTS"):
        print(f'\n    "{name}": "{digest(trace)}",')
    assert sum(len(step["run"]) for step in trace[:-1]) > 100  # the scenario did real work
    assert any(step["preempted"] for step in trace[:-1]) or name == "many-decodes"
    assert digest(trace) == DIGESTS[name]
