"""docs/engine.md against the engine it documents, used as a reader of the page would use it:
the Python snippet runs as written and its comments name real fields; the scheduler keeps the
order, budgets, preemption rules and policies the page states (in-process, on the simulated
executor and its virtual clock); the models, presets, memory sizing, sampling options, malloc
and garbage-collector settings are the code's (one small PyTorch engine, reconfigured per test);
`fairgate engine` takes the command line the page shows, with its defaults and one-line
refusals; the engine server answers each route of the endpoint table with the fields the page
names, errors in the shapes and codes it names and wants keys where it says; the Python API has
the signatures and behaviour listed; the kernels are the ones the table lists. Lists are read
from the page and compared with the code's both ways where the page means them to be whole."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig, LLMEngine, SamplingParams, StepOutput
from engine.async_engine import AsyncEngine, EngineOverloaded, RequestOutput
from engine.clock import VirtualClock
from engine.config import KNOBS, POLICIES, PREEMPTION_MODES, EngineAccess
from engine.executor import ModelOutput
from engine.heap import serving_heap, size_young_generation
from engine.host_memory import OPERATOR_ENV, SETTINGS
from engine.model_config import ARCHITECTURES, ROPE_TYPES, ModelConfig
from engine.presets import MODEL_PRESETS
from engine.request import FinishReason, RequestStatus
from engine.scheduler import FAR_AHEAD_PREFILL_SHARE, SchedulerOutput
from engine.server import ENGINE_KEY, freeze_startup_heap, make_app
from engine.sim import SimExecutor
from engine.vllm_flags import VLLM_FLAGS
from fairgate.cli import build_parser, main
from fairgate.engine_cli import build_access, build_config, flag_knobs
from tests.gateway.helpers import start_gateway
from tests.support.engines import sim_config
from tests.support.waiting import wait_for
from tests.test_design_contract import printed_help

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "engine.md"
Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]
GiB = 1 << 30
KEY = "engine-key-0123456789"


# ---- the page ------------------------------------------------------------------------------------
def part(heading: str) -> str:
    """The text under the heading `heading` (any level), up to the next heading of that level
    or above; lines inside code fences are not headings."""
    lines, fenced = PAGE.read_text().splitlines(), False
    body: list[str] = []
    level = 0
    for line in lines:
        fenced ^= line.startswith("```")
        found = re.match(r"(#+) (.*)", line) if not fenced else None
        if level and found and len(found[1]) <= level:
            break
        if level:
            body.append(line)
        elif found and found[2] == heading:
            level = len(found[1])
    assert level, f"docs/engine.md has no heading '{heading}'"
    return "\n".join(body)


def flat(text: str) -> str:
    return " ".join(text.split())


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def fence(text: str, language: str = "") -> str:
    """The first fenced block of `text` opened with ```language."""
    found = re.search(rf"^```{language}\n(.*?)^```", text, re.S | re.M)
    assert found, f"no ```{language} block"
    return found[1]


def sentence(text: str, words: str) -> str:
    """The sentence of `text` (flattened) holding `words`."""
    found = [s for s in re.split(r"(?<=\.)\s+(?=[A-Z`])", flat(text)) if words in s]
    assert found, f"no sentence says '{words}'"
    return found[0]


def table(text: str) -> dict[str, str]:
    """A markdown table's rows: first cell -> the rest of the row."""
    rows = [line.strip().strip("|").strip() for line in text.splitlines()
            if line.startswith("|")]
    return {row.split(" | ", 1)[0]: row.split(" | ", 1)[1] for row in rows[1:]
            if not set(row) <= set("-| ")}


# ---- engines -------------------------------------------------------------------------------------
def sim_engine(**changes: Any) -> LLMEngine:
    """random:tiny's shape on the simulated executor and its virtual clock."""
    return LLMEngine(sim_config(**changes))


def run_to_end(eng: LLMEngine, limit: int = 2000) -> list[StepOutput]:
    outs = []
    while eng.has_unfinished():
        outs.append(eng.step())
        assert len(outs) < limit, "the engine never finished"
    return outs


def steps_of(eng: LLMEngine) -> Iterator[StepOutput]:
    """Its steps, until it has nothing left."""
    while eng.has_unfinished():
        yield eng.step()


def admission_order(outs: list[StepOutput]) -> list[str]:
    """Request ids in the order they were first scheduled."""
    return list(dict.fromkeys(rid for out in outs for rid in out.scheduled))


class GatedSim(SimExecutor):
    """The simulated executor, gated: while `gated`, each step waits for a permit the test
    gives (`allow`), so the engine thread can be held between two steps; `waiting` says a step
    is waiting for one. A step's snapshot (`AsyncEngine.load()`) is published before the next
    step starts, so a step waiting means every earlier step is visible."""

    def __init__(self, config: EngineConfig, clock: VirtualClock) -> None:
        super().__init__(config, clock)
        self.gated = False
        self.waiting = False
        self.steps = 0
        self._permits = threading.Semaphore(0)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        if self.gated:
            self.waiting = True
            assert self._permits.acquire(timeout=10), "the test gave no permit"
            self.waiting = False
        self.steps += 1
        return super().execute(plan)

    def allow(self, steps: int) -> None:
        for _ in range(steps):
            self._permits.release()


class Recorder:
    """An EngineObserver keeping each step's output."""

    def __init__(self, steps: list[StepOutput]) -> None:
        self.steps = steps

    def on_step(self, output: StepOutput) -> None:
        self.steps.append(output)

    def on_finished(self, record: Any) -> None:
        pass


def gated_engine(**changes: Any) -> tuple[AsyncEngine, GatedSim]:
    config, clock = sim_config(**changes), VirtualClock()
    executor = GatedSim(config, clock)
    return AsyncEngine.from_engine(LLMEngine(config, executor=executor, clock=clock)), executor


@contextlib.contextmanager
def gated(executor: GatedSim) -> Iterator[None]:
    """Steps wait for permits inside the block; after it, whatever happened, they run freely."""
    executor.gated = True
    try:
        yield
    finally:
        executor.gated = False
        executor.allow(1)  # the step waiting, if any


async def held_after(executor: GatedSim, steps: int,
                     done: Callable[[], bool] = lambda: False) -> None:
    """Let `steps` more steps run, then wait until the next one waits for its permit (or
    until `done()`, when no step may come)."""
    target = executor.steps + steps
    executor.allow(steps)
    await wait_for(lambda: done() or (executor.steps == target and executor.waiting))


async def step_until(executor: GatedSim, condition: Callable[[], bool]) -> None:
    """One step at a time until `condition()` holds (what the event loop is doing meanwhile,
    a request on its way to the engine, gets each step's time to arrive)."""
    for _ in range(50):
        if condition():
            return
        await held_after(executor, 1, condition)
    raise AssertionError("the condition never held")


async def collect(outputs: Any) -> list[RequestOutput]:
    return [out async for out in outputs]


# ---- the snippet ---------------------------------------------------------------------------------
def test_the_python_snippet_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    code = fence(PAGE.read_text(), "python")
    scope: dict[str, Any] = {}
    exec(compile(code, str(PAGE), "exec"), scope)  # noqa: S102 - the page's own example
    eng, out = scope["eng"], scope["out"]
    assert isinstance(eng, LLMEngine) and not eng.has_unfinished()
    assert out.finished == {"r1": FinishReason.LENGTH}
    printed = capsys.readouterr().out
    assert printed.startswith("{'running': 0")


def test_the_snippets_comments_name_step_output_and_stats_fields() -> None:
    code = fence(PAGE.read_text(), "python")
    step_fields = set(re.findall(r"\bout\.(\w+)", code.split("out = eng.step()", 1)[1]))
    assert step_fields == {"scheduled", "sampled", "outputs", "finished", "preempted"}
    assert [f for f in step_fields if not hasattr(StepOutput(), f)] == []
    stats_comment = code.split("print(eng.stats())", 1)[1].split("#", 1)[1]
    named = [w.strip() for w in stats_comment.split(",")]
    keys = {"prefix hits": "prefix_cache_hits"}
    stats = sim_engine().stats()
    assert [w for w in named if keys.get(w, w) not in stats] == []


def test_sampled_is_the_token_of_each_request_and_outputs_the_same_as_lists() -> None:
    eng = sim_engine()
    eng.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    eng.add_request("r2", [4, 5, 6, 7], SamplingParams(max_tokens=4))
    for out in run_to_end(eng):
        assert out.outputs == {rid: [token] for rid, token in out.sampled.items()}
        assert set(out.sampled) <= set(out.scheduled)


def test_intro_names_the_executors_the_config_takes() -> None:
    intro = PAGE.read_text().split("\n## ", 1)[0]
    assert "a simulated and a PyTorch executor" in flat(intro)
    assert EngineConfig(executor="sim").executor == "sim"
    assert EngineConfig().executor == "torch"
    with pytest.raises(ValueError, match="executor must be one of"):
        EngineConfig(executor="jax")


# ---- scheduling ----------------------------------------------------------------------------------
def status_rank(eng: LLMEngine, rid: str) -> int:
    """Where the page puts a request in a step: running decodes 0, running partial prefills 1,
    swapped 2, waiting (new prefills) 3."""
    request = eng.get_request(rid)
    assert request is not None
    if request.status is RequestStatus.RUNNING:
        return 0 if request.num_remaining_tokens == 1 else 1
    return 2 if request.status is RequestStatus.SWAPPED else 3


def test_each_step_keeps_the_budgets_and_the_order_decodes_partials_swapped_new() -> None:
    eng = sim_engine(preemption="swap", num_kv_blocks=24, max_model_len=192,
                     max_num_batched_tokens=96, max_num_seqs=6)
    seen: set[tuple[int, ...]] = set()
    live: set[str] = set()
    for i in range(1000):
        if i < 24:  # one arrival a step
            rid = f"r{i}"
            eng.add_request(rid, [1 + i % 7] * (8 + 37 * i % 120), SamplingParams(max_tokens=60),
                            priority="batch" if i % 3 else "interactive")
            live.add(rid)
        elif not live:
            break
        ranks = {rid: status_rank(eng, rid) for rid in live}
        out = eng.step()
        order = [ranks[rid] for rid in out.scheduled]
        assert order == sorted(order), out.scheduled
        assert out.num_batched_tokens == sum(out.scheduled.values()) <= 96
        assert len(out.scheduled) <= 6 and eng.stats()["free_blocks"] >= 0
        seen.add(tuple(sorted(set(order))))
        live -= set(out.finished)
    reached = set().union(*seen)
    assert reached == {0, 1, 2, 3}, "the workload never had every kind of request in a step"
    assert any(len(kinds) >= 3 for kinds in seen)


def test_a_prompt_larger_than_the_budget_left_is_chunked() -> None:
    eng = sim_engine(max_num_batched_tokens=64)
    eng.add_request("decode", [1, 2, 3], SamplingParams(max_tokens=50))
    eng.step()
    eng.add_request("long", list(range(1, 101)), SamplingParams(max_tokens=5))
    assert eng.step().scheduled == {"decode": 1, "long": 63}
    assert eng.step().scheduled == {"decode": 1, "long": 37}


def test_the_victim_is_batch_before_interactive_then_the_latest_arrival() -> None:
    eng = sim_engine(num_kv_blocks=6, max_model_len=96)
    for rid, priority, arrival in (("i1", "interactive", 0.0), ("b1", "batch", 1.0),
                                   ("i2", "interactive", 2.0)):
        eng.add_request(rid, [5] * 30, SamplingParams(max_tokens=60), priority=priority,
                        arrival_time=arrival)
    victims = [rid for out in run_to_end(eng) for rid in out.preempted]
    assert victims[:2] == ["b1", "i2"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("held_by_batch", ["seats", "blocks"])
def test_interactive_work_preempts_batch_work_whatever_the_policy(policy: str,
                                                                  held_by_batch: str) -> None:
    seats = held_by_batch == "seats"
    eng = sim_engine(policy=policy, max_num_seqs=2 if seats else 4, num_kv_blocks=8,
                     max_model_len=128)
    prompt = 8 if seats else 60  # blocks: two prompts of 4 blocks hold all 8
    for rid in ("b1", "b2"):
        eng.add_request(rid, [3] * prompt, SamplingParams(max_tokens=60), priority="batch")
    eng.step()
    eng.add_request("i", [9] * 20, SamplingParams(max_tokens=4), priority="interactive")
    out = eng.step()
    assert out.preempted == ["b2"] and "i" in out.scheduled


def test_swap_preemption_moves_the_victim_to_host_memory() -> None:
    eng = sim_engine(preemption="swap", num_kv_blocks=8, max_model_len=128)
    for rid in ("a", "b"):
        eng.add_request(rid, [1] * 39, SamplingParams(max_tokens=80))
    out = next(o for o in steps_of(eng) if o.preempted)
    victim = eng.get_request(out.preempted[0])
    assert victim is not None and victim.status is RequestStatus.SWAPPED
    assert eng.stats()["swapped"] == 1


def test_swap_falls_back_to_recompute_when_the_host_swap_space_is_full() -> None:
    eng = sim_engine(preemption="swap", swap_space_gb=1e-9, num_kv_blocks=8,
                     max_model_len=128)
    assert eng.capacity.num_host_blocks == 0
    for rid in ("a", "b"):
        eng.add_request(rid, [1] * 39, SamplingParams(max_tokens=80))
    out = next(o for o in steps_of(eng) if o.preempted)
    victim = eng.get_request(out.preempted[0])
    assert victim is not None and victim.status is RequestStatus.WAITING
    assert victim.num_computed_tokens == 0 and eng.stats()["swapped"] == 0
    fallback = sentence(part("Scheduling"), "falls back")
    assert "recompute" in fallback and "swap_space_gb" in fallback


def test_the_preemption_modes_are_the_pages() -> None:
    said = sentence(part("Scheduling"), "a victim is preempted")
    found = re.search(r"by (\w+) or (\w+)", said)
    assert found and set(found.groups()) == set(PREEMPTION_MODES)
    with pytest.raises(ValueError, match="preemption must be one of"):
        EngineConfig(preemption="evict")


def documented_policies() -> dict[str, str]:
    """Each policy the Scheduling section names, with what it says the order is."""
    said = sentence(part("Scheduling"), "The `policy` knob")
    return dict(re.findall(r"`(\w+)` \(([^)]*)\)", said.split(":", 1)[1]))


def test_the_page_names_every_policy_and_the_config_takes_each() -> None:
    assert sorted(documented_policies()) == sorted(POLICIES)
    for policy in documented_policies():
        assert EngineConfig(policy=policy).policy == policy
    with pytest.raises(ValueError, match="policy must be one of fcfs | priority"):
        EngineConfig(policy="lottery")


def order_under(policy: str) -> list[str]:
    """The order one seat admits a workload in: x1 (40 tokens), y1 (4 tokens, another tenant),
    x2 (x's second) and z1, whose prompt starts with 48 tokens cached by a warm-up, arriving in
    that order, all interactive (an interactive request would evict a batch one from the seat)."""
    eng = sim_engine(policy=policy, max_num_seqs=1)
    warm = [7] * 48
    eng.add_request("warm", warm, SamplingParams(max_tokens=1), tenant="z")
    run_to_end(eng)
    for rid, prompt, tenant in (("x1", [1] * 40, "x"), ("y1", [2] * 4, "y"),
                                ("x2", [3] * 40, "x"), ("z1", [*warm, 4], "z")):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=2), tenant=tenant)
    return admission_order(run_to_end(eng))


EXPECTED_ORDER = {
    "fcfs": ["x1", "y1", "x2", "z1"],  # arrival
    "priority": ["x1", "y1", "x2", "z1"],  # one priority class: arrival
    "sjf": ["y1", "x1", "x2", "z1"],  # least work first (arrivals tie on the virtual clock)
    "prefix": ["z1", "x1", "y1", "x2"],  # the cached prefix first, then arrival
    "fair": ["x1", "y1", "z1", "x2"],  # x served once: the others before x's second
}


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_admits_in_the_order_the_page_says(policy: str) -> None:
    assert order_under(policy) == EXPECTED_ORDER[policy], documented_policies()[policy]


@pytest.mark.parametrize(("policy", "first"), [("priority", "interactive"), ("fcfs", "batch")])
def test_priority_gives_the_budget_to_interactive_work_first(policy: str, first: str) -> None:
    eng = sim_engine(policy=policy, max_num_batched_tokens=64)
    eng.add_request("batch", [1] * 60, SamplingParams(max_tokens=2), priority="batch")
    eng.add_request("interactive", [2] * 60, SamplingParams(max_tokens=2))
    scheduled = eng.step().scheduled
    assert scheduled[first] == 60 and sum(scheduled.values()) == 64


def fair_engine(far_ahead_tokens: int) -> LLMEngine:
    """`heavy` far ahead of `light` (a 100-token prefill at weight 0.1), light still decoding."""
    eng = sim_engine(policy="fair", fair_far_ahead_tokens=far_ahead_tokens, num_kv_blocks=256)
    eng.add_request("l0", [1] * 5, SamplingParams(max_tokens=200), tenant="light")
    eng.add_request("h0", list(range(1, 101)), SamplingParams(max_tokens=1), tenant="heavy",
                    tenant_weight=0.1)
    eng.step()
    eng.step()
    return eng


def test_fair_a_far_ahead_tenants_prefills_stay_out_of_a_step_that_starts_one_behind() -> None:
    said = flat(part("Scheduling"))
    assert "`fair_far_ahead_tokens`" in said and "1/8 of the budget" in said
    assert FAR_AHEAD_PREFILL_SHARE == 8
    eng = fair_engine(far_ahead_tokens=64)
    for i in range(1, 5):
        eng.add_request(f"h{i}", [7] * 10, SamplingParams(max_tokens=1), tenant="heavy")
    eng.add_request("l1", [3] * 10, SamplingParams(max_tokens=3), tenant="light")
    assert eng.step().scheduled == {"l0": 1, "l1": 10}  # light's start: no heavy prefill
    # then heavy's: the first, and more only while new prefill tokens stay within 256 / 8
    assert eng.step().scheduled == {"l0": 1, "l1": 1, "h1": 10, "h2": 10, "h3": 10}
    assert eng.step().scheduled == {"l0": 1, "l1": 1, "h4": 10}


def test_fair_tenants_within_fair_far_ahead_tokens_are_not_limited() -> None:
    eng = fair_engine(far_ahead_tokens=10**6)
    for i in range(1, 5):
        eng.add_request(f"h{i}", [7] * 10, SamplingParams(max_tokens=1), tenant="heavy")
    eng.add_request("l1", [3] * 10, SamplingParams(max_tokens=3), tenant="light")
    assert set(eng.step().scheduled) == {"l0", "l1", "h1", "h2", "h3", "h4"}


def test_fair_a_tenant_alone_is_never_far_ahead() -> None:
    eng = sim_engine(policy="fair", fair_far_ahead_tokens=1, num_kv_blocks=256)
    eng.add_request("h0", list(range(1, 101)), SamplingParams(max_tokens=50), tenant="heavy",
                    tenant_weight=0.1)
    eng.step()
    for i in range(1, 5):
        eng.add_request(f"h{i}", [7] * 40, SamplingParams(max_tokens=1), tenant="heavy")
    assert set(eng.step().scheduled) == {"h0", "h1", "h2", "h3", "h4"}


# ---- models --------------------------------------------------------------------------------------
def models_bullet(start: str) -> str:
    bullets = re.split(r"\n- ", part("Models"))
    [found] = [flat(b) for b in bullets if b.startswith(start)]
    return found


def test_the_architectures_are_llama_mistral_and_qwen2() -> None:
    said = flat(part("Models").strip().split("\n\n")[0])
    families = {"Llama": "LlamaForCausalLM", "Mistral": "MistralForCausalLM",
                "Qwen2": "Qwen2ForCausalLM"}
    assert [name for name in families if name not in said] == []
    assert sorted(families.values()) == sorted(ARCHITECTURES)
    assert "llama3" in ROPE_TYPES
    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_hf(qwen).attention_bias  # q/k/v bias
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):  # SwiGLU only
        ModelConfig.from_hf({**qwen, "hidden_act": "gelu"})


def test_the_random_presets_are_the_pages() -> None:
    bullet = models_bullet("`model: random:<preset>`")
    presets = [name for name in ticked(bullet)[1:] if not name.startswith("model")]
    assert sorted(presets) == sorted(MODEL_PRESETS)
    millions = re.search(r"`tiny` \((\d+) M parameters, the CPU default\)", bullet)
    assert millions and round(MODEL_PRESETS["tiny"].num_params / 1e6) == int(millions[1])
    assert EngineConfig().model == "random:tiny"


def write_checkpoint(folder: Path, config: dict[str, Any], tensors: dict[str, Any]) -> str:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}


def test_a_bad_checkpoint_fails_at_load_naming_the_file_and_tensor(tmp_path: Path) -> None:
    import torch

    def load(path: str) -> None:
        LLMEngine(EngineConfig(model=path, device="cpu", max_model_len=64, num_kv_blocks=8))

    with pytest.raises(ValueError, match=r"config\.json: file not found"):
        load(str(tmp_path))
    bad_arch = write_checkpoint(tmp_path / "gpt", {**LLAMA, "architectures": ["GPT2LMHeadModel"]},
                                {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"config\.json: architecture 'GPT2LMHeadModel' is not"):
        load(bad_arch)
    shape = write_checkpoint(tmp_path / "shape", LLAMA,
                             {"model.embed_tokens.weight": torch.zeros(16, 4)})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.embed_tokens\."
                       r"weight' has shape \(16, 4\), expected \(16, 8\)"):
        load(shape)
    missing = write_checkpoint(tmp_path / "missing", LLAMA,
                               {"model.embed_tokens.weight": torch.zeros(16, 8)})
    with pytest.raises(ValueError, match=r"missing: missing weights in the \*\.safetensors "
                       r"files: model\.layers\.0\.self_attn\.q_proj\.weight"):
        load(missing)


def test_generation_config_gives_the_eos_ids(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from engine.loader import read_eos_ids
    from engine.tokenizer import ByteTokenizer

    assert "`generation_config.json` (EOS ids)" in models_bullet("`model: /path/to/checkpoint`")
    tokenizer = ByteTokenizer()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_eos_ids(tmp_path, tokenizer) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert read_eos_ids(tmp_path, tokenizer) == (5, 6)


@pytest.fixture(scope="module")
def torch_engine() -> LLMEngine:
    """random:tiny on the CPU, its KV cache sized from 1 GiB of "device" memory."""
    pytest.importorskip("torch")
    return LLMEngine(torch_config())


def torch_config(**changes: Any) -> EngineConfig:
    base = EngineConfig(model="random:tiny", device="cpu", max_model_len=256,
                        max_num_batched_tokens=256, max_num_seqs=16, device_memory_gb=1.0)
    return base.replace(**changes)


def runner(eng: LLMEngine) -> Any:
    """The engine's PyTorch executor (engine/runner.py), for what only it has: memory sizes,
    the model, the cache."""
    return eng.executor


def reconfigured(eng: LLMEngine, **changes: Any) -> LLMEngine:
    eng.reconfigure(torch_config(**changes))
    return eng


def test_random_presets_are_deterministic_with_a_byte_level_tokenizer(
        torch_engine: LLMEngine) -> None:
    import torch

    from engine.loader import load_model
    from engine.tokenizer import ByteTokenizer
    from kernels import get_ops

    said = models_bullet("`model: random:<preset>`")
    assert "deterministic random weights with a byte-level tokenizer" in said
    assert isinstance(torch_engine.tokenizer, ByteTokenizer)
    again = load_model("random:tiny", get_ops("torch"), torch.device("cpu"), torch.float32, 0)
    ours = runner(torch_engine).model.state_dict()
    assert all(torch.equal(ours[name], tensor)
               for name, tensor in again.model.state_dict().items())


def test_kv_blocks_are_device_memory_x_fraction_less_weights_and_activations(
        torch_engine: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    said = models_bullet("KV memory is sized")
    assert ("blocks = (device memory x `memory_fraction` - weights - activation peak at "
            "`max_num_batched_tokens`) / bytes per block") in said
    with caplog.at_level("INFO", logger="fairgate.engine"):
        eng = reconfigured(torch_engine)
    executor, config = runner(eng), eng.config
    budget = (1.0 * GiB * config.memory_fraction - executor.weight_bytes()
              - executor.activation_peak_bytes(config))
    assert eng.stats()["num_blocks"] == int(budget // executor.bytes_per_block(config))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    tokens = eng.stats()["num_blocks"] * 16
    assert f"= {tokens} tokens" in line and "maximum concurrency at max_model_len 256" in line


def test_cpu_device_memory_defaults_to_min_4_gib_and_a_quarter_of_ram() -> None:
    pytest.importorskip("torch")
    import torch

    from engine.runner import default_device_memory

    assert "(default min(4 GiB, 25% of RAM))" in models_bullet("KV memory is sized")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_device_memory(torch.device("cpu")) == min(4 * GiB, ram // 4)
    assert EngineConfig().device_memory_gb is None


def test_too_little_memory_is_an_error_naming_the_knobs(torch_engine: LLMEngine) -> None:
    with pytest.raises(ValueError) as refused:
        reconfigured(torch_engine, device_memory_gb=0.01)
    for knob in ("device_memory_gb", "memory_fraction", "max_num_batched_tokens",
                 "max_model_len", "num_kv_blocks"):
        assert knob in str(refused.value)


def test_an_int8_kv_cache_holds_int8_with_float32_scales_per_token_and_head(
        torch_engine: LLMEngine) -> None:
    import torch

    said = models_bullet("KV memory is sized")
    assert "`kv_cache_dtype: int8` stores K/V as int8 with a float32 scale per token and KV" in said
    eng = reconfigured(torch_engine, kv_cache_dtype="int8", num_kv_blocks=32)
    layer = runner(eng).kv_cache.layers[0]
    shape = runner(eng).model_config
    assert layer.k_cache.dtype == torch.int8
    assert layer.k_cache.shape == (32, 16, shape.num_kv_heads, shape.head_dim)
    assert layer.k_scale is not None and layer.k_scale.dtype == torch.float32
    assert layer.k_scale.shape == (32, 16, shape.num_kv_heads)


def test_a_preempted_seeded_request_replays_the_same_tokens(torch_engine: LLMEngine) -> None:
    said = models_bullet("Sampling is vectorised")
    assert "per-request seed (a preempted request replays the same tokens)" in said
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
    prompt = list(range(30, 44))
    eng = reconfigured(torch_engine, num_kv_blocks=3, max_model_len=48)
    eng.add_request("alone", prompt, params)
    alone = run_to_end(eng)
    expected = [out.sampled["alone"] for out in alone if "alone" in out.sampled]
    # each holds one block of the three; at its 17th token each needs a second: the latest
    # arrival, the seeded one, is preempted, and runs again once the first is done
    eng.add_request("first", list(range(60, 74)), SamplingParams(max_tokens=10))
    eng.add_request("seeded", prompt, params)
    outs = run_to_end(eng)
    assert "seeded" in [rid for out in outs for rid in out.preempted]
    got = [out.sampled["seeded"] for out in outs if "seeded" in out.sampled]
    assert got == expected


def test_every_sampling_option_listed_is_a_sampling_param_and_one_batch_takes_them_all(
        torch_engine: LLMEngine) -> None:
    said = models_bullet("Sampling is vectorised")
    options = {"greedy": "temperature", "temperature": "temperature", "top-k": "top_k",
               "top-p": "top_p", "min-p": "min_p", "seed": "seed",
               "presence/frequency/repetition penalties": "repetition_penalty",
               "stop token ids": "stop_token_ids", "logprobs": "logprobs"}
    assert [o for o in options if o not in said] == []
    names = {f.name for f in fields(SamplingParams)}
    assert {*options.values(), "presence_penalty", "frequency_penalty"} <= names
    assert SamplingParams().greedy
    eng = reconfigured(torch_engine, num_kv_blocks=64)
    variants = [SamplingParams(max_tokens=3),
                SamplingParams(max_tokens=3, temperature=0.8, top_k=5),
                SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, min_p=0.05, seed=3),
                SamplingParams(max_tokens=3, temperature=0.7, presence_penalty=0.5,
                               frequency_penalty=0.5, repetition_penalty=1.2),
                SamplingParams(max_tokens=3, logprobs=3)]
    for i, params in enumerate(variants):
        eng.add_request(f"v{i}", [10 + i] * 12, params)
    outs = run_to_end(eng)
    assert {rid for out in outs for rid in out.finished} == {f"v{i}" for i in range(5)}
    logprobs = [out.logprobs["v4"] for out in outs if "v4" in out.logprobs]
    sampled = [out.sampled["v4"] for out in outs if "v4" in out.sampled]
    assert len(logprobs) == 3 and all(len(lp) >= 3 for lp in logprobs)
    assert all(token in lp for token, lp in zip(sampled, logprobs, strict=True))


def test_stop_token_ids_end_a_request() -> None:
    eng = sim_engine()
    eng.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8))
    tokens = [out.sampled["r1"] for out in run_to_end(eng) if "r1" in out.sampled]
    eng.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=(tokens[2],)))
    outs = run_to_end(eng)
    assert outs[-1].finished == {"r1": FinishReason.STOP} and len(outs) == 3


def test_the_engine_sets_glibc_malloc_to_the_pages_thresholds(torch_engine: LLMEngine) -> None:
    from engine import host_memory

    said = models_bullet("On CPU the engine sets glibc's malloc")
    assert "mmap threshold 32 MiB, trim threshold 1 GiB, top pad 64 MiB" in said
    values = dict(SETTINGS)
    assert values == {host_memory.M_MMAP_THRESHOLD: 32 << 20,
                      host_memory.M_TRIM_THRESHOLD: 1 << 30, host_memory.M_TOP_PAD: 64 << 20}
    assert host_memory.state() is not None  # the CPU engine applied it (or left it to the env)


def test_the_operators_malloc_variables_the_page_names_are_the_codes() -> None:
    said = models_bullet("On CPU the engine sets glibc's malloc")
    named = [n for n in ticked(said.split("in the environment")[0]) if n.isupper()]
    assert sorted(named) == sorted(OPERATOR_ENV)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
@pytest.mark.parametrize("variable", OPERATOR_ENV)
def test_an_operators_malloc_variable_leaves_malloc_to_it(variable: str) -> None:
    code = ("from engine import host_memory; host_memory.keep_step_memory(); "
            "print(host_memory.state())")
    env = {k: v for k, v in os.environ.items() if k not in OPERATOR_ENV}
    env[variable] = "glibc.malloc.check=0" if variable == "GLIBC_TUNABLES" else "4194304"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60, check=True)
    assert done.stdout.strip() == f"malloc left to ${variable}"


# ---- the garbage collector -----------------------------------------------------------------------
@pytest.fixture
def collector() -> Iterator[None]:
    """gc's thresholds at CPython's defaults for the test, put back after it."""
    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("collector")
def test_the_young_generation_is_20_x_max_num_seqs_never_lowered_and_off_stays_off() -> None:
    said = models_bullet("The engine's server processes")
    assert "20 x `max_num_seqs` objects (CPython's default is 700;" in said
    assert size_young_generation(1024) == 20 * 1024 == gc.get_threshold()[0]
    gc.set_threshold(700, 10, 10)
    assert size_young_generation(8) == 700  # 160 would lower it
    gc.set_threshold(0)
    assert size_young_generation(1024) == 0 == gc.get_threshold()[0]


@pytest.mark.usefixtures("collector")
def test_serving_heap_freezes_and_sizes_then_undoes_both() -> None:
    frozen_before = gc.get_freeze_count() > 0  # a heap frozen before stays frozen
    with serving_heap(64):
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == 20 * 64
    assert (gc.get_freeze_count() > 0) == frozen_before and gc.get_threshold()[0] == 700


async def test_freeze_startup_heap_freezes_the_heap() -> None:
    try:
        await freeze_startup_heap(web.Application())
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


# ---- `fairgate engine` ---------------------------------------------------------------------------
class Served:
    """`protocol.serving.serve` as `fairgate engine` and `fairgate serve` call it, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[web.Application, str, int]] = []

    def __call__(self, app: web.Application, host: str, port: int, **_: Any) -> None:
        self.calls.append((app, host, port))


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Served:
    record = Served()
    monkeypatch.setattr("fairgate.engine_cli.serve", record)
    monkeypatch.setattr("fairgate.serve_cli.serve", record)
    return record


def usage() -> str:
    return flat(fence(part("`fairgate engine`: a standalone engine server")))


def test_help_names_every_option_of_the_usage_block(capsys: pytest.CaptureFixture[str]) -> None:
    shown = set(re.findall(r"(?<![\w-])-{1,2}[a-z][\w-]*", printed_help(capsys, main, "engine")))
    options = re.findall(r"(?<![\w-])-{1,2}[a-z][\w-]*", usage())
    assert [o for o in options if o not in shown] == []
    assert "MODEL" in printed_help(capsys, main, "engine")


def test_the_usage_blocks_values_are_the_defaults() -> None:
    args = build_parser(["engine"]).parse_args(["engine"])
    stated = dict(re.findall(r"\[(--[\w-]+) ([a-z0-9.]+)\]", usage()))
    assert stated.pop("--metrics-compat") == "vllm"  # the one value it takes
    assert {flag: str(getattr(args, flag[2:].replace("-", "_"))) for flag in stated} == stated
    assert set(stated) == {"--host", "--port", "--log-level"}


def test_the_command_line_overrides_the_files_engine_section(tmp_path: Path) -> None:
    said = flat(part("`fairgate engine`: a standalone engine server"))
    assert ("Knobs come from the `engine` section of `fairgate.yaml`; the command line "
            "overrides them") in said
    path = tmp_path / "fairgate.yaml"
    path.write_text("engine: {max_num_seqs: 8, policy: sjf, memory_fraction: 0.5}\n")
    argv = ["engine", "-c", str(path), "--set", "max_num_seqs=16",
            "--gpu-memory-utilization", "0.7"]
    args = build_parser(argv).parse_args(argv)
    config = build_config(args.config, args.overrides, flag_knobs(args))
    assert (config.max_num_seqs, config.memory_fraction, config.policy) == (16, 0.7, "sjf")


def test_set_values_are_yaml_and_the_examples_build() -> None:
    said = flat(part("`fairgate engine`: a standalone engine server"))
    example = re.search(r"`(--set max_num_seqs=32 --set enable_prefix_caching=false)`", said)
    assert example
    config = build_config(None, example[1].split()[1::2])
    assert (config.max_num_seqs, config.enable_prefix_caching) == (32, False)
    vllm = re.search(r"`fairgate engine (/models/llama-3-8b [^`]*)`", said)
    assert vllm
    argv = vllm[1].split()
    args = build_parser(["engine", *argv]).parse_args(["engine", *argv])
    config = build_config(None, [], flag_knobs(args))
    assert (config.model, config.max_num_seqs, config.memory_fraction,
            config.served_model_name) == ("/models/llama-3-8b", 128, 0.85, ("llama-3-8b",))
    assert {"--max-num-seqs", "--gpu-memory-utilization"} <= {f.flag for f in VLLM_FLAGS}


@pytest.mark.usefixtures("collector")
def test_the_example_without_a_model_serves_the_sim_on_the_default_address(
        served: Served) -> None:
    said = flat(part("`fairgate engine`: a standalone engine server"))
    example = re.search(r"Example without a model: `fairgate engine ([^`]*)`", said)
    assert example
    assert main(["engine", *example[1].split(), "--set", "max_num_seqs=96"]) == 0
    [(app, host, port)] = served.calls
    engine = app[ENGINE_KEY]
    assert (engine.config.executor, engine.config.sim_model, engine.config.sim_clock) == (
        "sim", "tiny", "realtime")
    assert (host, port) == ("127.0.0.1", 8100)
    assert engine.llm_engine.executor is not None  # the model loaded before serving
    assert freeze_startup_heap in app.on_startup
    assert gc.get_threshold()[0] == 20 * 96


@pytest.mark.usefixtures("collector")
def test_fairgate_serve_with_the_engine_embedded_sizes_the_collector_too(
        served: Served, tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(f"database: sqlite+aiosqlite:///{tmp_path / 'gw.db'}\n"
                    "engine: {executor: sim, sim_model: tiny, max_num_seqs: 80}\n")
    assert main(["serve", "-c", str(path)]) == 0
    [(app, _, _)] = served.calls
    assert freeze_startup_heap in app.on_startup
    assert gc.get_threshold()[0] == 20 * 80


@pytest.mark.parametrize("argv", [
    ["--set", "max_num_seqs=0"],
    ["--max-num-seqs", "8", "--set", "max_num_seqs=8"],
    ["--set", "model=/no/such/checkpoint"],
    ["--set", "executor=sim", "--set", "sim_model=tiny", "--set", "max_model_len=100000"],
    ["--host", "0.0.0.0", "--set", "executor=sim"],
], ids=["bad-value", "flag-and-set", "no-model", "too-long", "open-host"])
def test_a_bad_setting_prints_one_line_exits_2_and_opens_no_port(
        served: Served, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(["engine", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairgate engine: error: ") and err.count("\n") == 1, err
    assert served.calls == []


@pytest.mark.parametrize("device", ["gpu", "cuda:99"])
def test_a_bad_device_prints_one_line_and_exits_2(
        served: Served, capsys: pytest.CaptureFixture[str], device: str) -> None:
    assert main(["engine", "--set", f"device={device}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairgate engine: error: ") and err.count("\n") == 1, err


def test_served_model_name_is_a_name_or_a_list() -> None:
    args = build_parser(["engine"]).parse_args(["engine", "--served-model-name", "a", "b"])
    assert build_config(None, [], flag_knobs(args)).served_model_name == ("a", "b")
    assert EngineConfig.from_dict({"served_model_name": "a"}).served_model_name == ("a",)


def test_an_engine_bound_beyond_loopback_refuses_to_start_without_a_key() -> None:
    def access(*argv: str) -> EngineAccess:
        args = build_parser(["engine", *argv]).parse_args(["engine", *argv])
        return build_access(args, {})

    with pytest.raises(ValueError, match="no api key is set"):
        access("--host", "0.0.0.0")
    assert access("--host", "0.0.0.0", "--api-key", KEY).api_key == KEY
    assert access("--host", "0.0.0.0", "--allow-unauthenticated").allow_unauthenticated
    assert access().api_key is None  # loopback: open


# ---- the server ----------------------------------------------------------------------------------
def endpoint_rows() -> dict[str, str]:
    return table(part("Endpoints"))


def documented_routes() -> set[tuple[str, str]]:
    routes = set()
    for cell in endpoint_rows():
        method = ""
        for token in ticked(cell):
            method, _, path = token.rpartition(" ") if " " in token else (method, "", token)
            routes.add((method, path.split("?")[0]))
    return routes


def served_routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD" and r.resource is not None}


def test_the_endpoint_table_lists_every_route_and_only_those() -> None:
    app = make_app(AsyncEngine(sim_config()))
    assert sorted(documented_routes()) == sorted(served_routes(app))


@pytest.fixture
async def client(aiohttp_client: MakeClient) -> Client:
    return await aiohttp_client(make_app(AsyncEngine(sim_config(
        policy="fair", served_model_name=["first-name", "second-name"]))))


def engine_of(client: Client) -> AsyncEngine:
    return client.app[ENGINE_KEY]  # type: ignore[index]


async def complete(client: Client, path: str = "/v1/completions", **body: Any) -> Any:
    body = {"prompt": "hello", "max_tokens": 3, **body}
    if path.endswith("chat/completions") and "messages" not in body:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    return await client.post(path, json=body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_prompt_token_ids_run_as_given(client: Client, path: str) -> None:
    row = flat(endpoint_rows()["`POST /v1/completions`, `POST /v1/chat/completions`"])
    assert {"tenant", "tenant_weight", "prompt_token_ids"} <= set(ticked(row))
    answer = await complete(client, path, prompt="a much longer prompt than four tokens",
                            prompt_token_ids=[5, 6, 7, 8])
    assert answer.status == 200, await answer.text()
    assert (await answer.json())["usage"]["prompt_tokens"] == 4


async def test_tenant_salts_the_prefix_cache(client: Client) -> None:
    assert "`tenant` (prefix-cache salt" in flat(part("Endpoints"))
    prompt = list(range(40, 90))  # three full blocks

    async def hits(tenant: str) -> int:
        before = engine_of(client).load()["prefix_cache_hits"]
        answer = await complete(client, prompt_token_ids=prompt, tenant=tenant)
        assert answer.status == 200
        return int(engine_of(client).load()["prefix_cache_hits"] - before)

    assert await hits("acme") == 0
    assert await hits("acme") == 48
    assert await hits("globex") == 0  # the same prompt, another tenant: no hit


async def test_tenant_weight_is_the_tenants_weight_for_fair(client: Client) -> None:
    answer = await complete(client, tenant="acme", tenant_weight=2.5)
    assert answer.status == 200
    assert engine_of(client).llm_engine.tenant_weights["acme"] == 2.5
    assert engine_of(client).config.policy == "fair"


async def test_models_lists_a_card_per_name_and_takes_every_name_or_the_model(
        client: Client) -> None:
    cards = (await (await client.get("/v1/models")).json())["data"]
    assert [(c["id"], c["root"]) for c in cards] == [("first-name", "random:tiny"),
                                                     ("second-name", "random:tiny")]
    for model in ("first-name", "second-name", "random:tiny"):
        answer = await complete(client, model=model)
        assert answer.status == 200 and (await answer.json())["model"] == "first-name"
    scraped = await (await client.get("/metrics")).text()
    assert 'fairgate_engine_requests_running{model_name="first-name"}' in scraped


@pytest.mark.parametrize("remote", [False, True], ids=["embedded", "remote"])
async def test_the_gateway_lists_the_first_name_and_takes_the_others_as_aliases(
        aiohttp_client: MakeClient, aiohttp_server: Any, tmp_path: Path, remote: bool) -> None:
    config = sim_config(served_model_name=["first-name", "second-name"], max_model_len=512)
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"
    if remote:
        server = await aiohttp_server(make_app(AsyncEngine(config)))
        h = await start_gateway(aiohttp_client, db_url,
                                gateway={"backends": [{"url": str(server.make_url("/"))}]})
        [backend] = h.gateway.pool.backends
        await wait_for(lambda: backend.healthy and backend.model_name == "first-name")
    else:
        h = await start_gateway(aiohttp_client, db_url, engine=config)
    cards = (await (await h.client.get("/v1/models", headers=h.auth("acme"))).json())["data"]
    assert [c["id"] for c in cards] == ["first-name"]
    for model in ("second-name", "random:tiny"):
        answer = await h.post("acme", {"model": model, "prompt": "hi", "max_tokens": 2})
        assert answer.status == 200 and (await answer.json())["model"] == "first-name"


async def test_health_and_readiness(client: Client) -> None:
    for path in ("/health", "/healthz"):
        answer = await client.get(path)
        assert answer.status == 200 and (await answer.json())["status"] == "ok"
    ready = await (await client.get("/readyz")).json()
    assert ready["status"] == "ready" and ready["reconfiguring"] is False


async def test_load_answers_the_fields_the_table_names(client: Client) -> None:
    row = endpoint_rows()["`GET /load`"]
    named = [t for t in ticked(row) if re.fullmatch(r"[a-z_]+", t)]
    assert len(named) == 10
    load = await (await client.get("/load")).json()
    assert [name for name in named if name not in load] == []
    assert (load["num_blocks"], load["max_num_seqs"], load["max_model_len"]) == (64, 16, 256)


def test_kv_usage_counts_unreferenced_cached_blocks_as_free() -> None:
    eng = sim_engine()
    eng.add_request("a", list(range(1, 50)), SamplingParams(max_tokens=2))
    eng.step()
    stats = eng.stats()
    assert stats["kv_usage"] == (stats["num_blocks"] - stats["free_blocks"]) / stats["num_blocks"]
    assert stats["kv_usage"] > 0
    run_to_end(eng)
    assert eng.stats()["kv_usage"] == 0 and eng.stats()["free_blocks"] == 64
    eng.add_request("b", list(range(1, 50)), SamplingParams(max_tokens=2))
    run_to_end(eng)
    assert eng.stats()["prefix_cache_hits"] == 48  # a's blocks stayed cached while "free"


async def test_stats_answers_the_fields_the_table_names(client: Client) -> None:
    [(route, row)] = [(k, v) for k, v in endpoint_rows().items() if "/stats" in k]
    query = re.search(r"/stats\?([^`]*)`", route)
    assert query
    params = dict(p.split("=") for p in query[1].split("&"))
    for _ in range(3):
        assert (await complete(client, max_tokens=4)).status == 200
    stats = await (await client.get("/stats")).json()
    assert stats["window_s"] == float(params["window"])  # the default window
    quantiles = re.findall(r"\b(p\d+|mean|max)\b", row.split(" over ")[0])
    for measure in ("ttft", "itl", "tpot", "e2e", "queue_time"):
        assert f"`{measure}`" in row
        assert [q for q in quantiles if q not in stats[measure]] == []
    for field in ("throughput", "goodput", "itl_attainment", "preemptions", "rejections"):
        assert f"`{field}`" in row and field in stats
    assert "by_reason" in stats["rejections"]
    assert "(requests with TTFT ≤ slo_ttft and TPOT ≤ slo_tpot)" in row
    assert "(the share of gaps ≤ slo_itl)" in row
    at_max = {f"slo_{m}": repr(stats[m]["max"]) for m in ("ttft", "tpot", "itl")}
    met = await (await client.get("/stats", params=at_max)).json()
    assert met["goodput"]["requests"] == 3 and met["itl_attainment"]["fraction"] == 1.0
    missed = await (await client.get("/stats", params=dict.fromkeys(at_max, "0"))).json()
    assert missed["goodput"]["requests"] == 0 and missed["itl_attainment"]["fraction"] == 0.0


async def test_admin_config_is_every_knob_and_the_reconfiguring_flag(client: Client) -> None:
    answer = await (await client.get("/admin/config")).json()
    assert sorted(answer) == ["config", "reconfiguring"] and answer["reconfiguring"] is False
    assert sorted(answer["config"]) == sorted(KNOBS)
    assert answer["config"]["policy"] == "fair"


async def test_reconfigure_answers_config_and_drain_time_and_takes_top_level_knobs(
        client: Client) -> None:
    row = flat(endpoint_rows()["`POST /admin/reconfigure`"])
    assert '`{"config", "drain_time_s"}`' in row
    nested = await client.post("/admin/reconfigure", json={
        "changes": {"max_num_seqs": 8}, "abort_running": False, "drain_timeout": None})
    assert nested.status == 200
    body = await nested.json()
    assert sorted(body) == ["config", "drain_time_s"] and body["config"]["max_num_seqs"] == 8
    top = await client.post("/admin/reconfigure", json={"max_num_seqs": 12})
    assert (await top.json())["config"]["max_num_seqs"] == 12
    assert engine_of(client).config.max_num_seqs == 12


def restart_knobs() -> list[str]:
    """The knobs the reconfigure row says need a restart."""
    row = flat(endpoint_rows()["`POST /admin/reconfigure`"])
    found = re.search(r"Knobs that need a restart \(([^)]*), \.\.\.\) are a 400", row)
    assert found, row
    return found[1].split(", ")


@pytest.mark.parametrize("knob", restart_knobs())
async def test_knobs_that_need_a_restart_are_a_400(client: Client, knob: str) -> None:
    value = {"model": "random:small", "executor": "torch", "device": "cpu",
             "dtype": "float16"}[knob]
    answer = await client.post("/admin/reconfigure", json={"changes": {knob: value}})
    assert answer.status == 400 and knob in (await answer.json())["error"]["message"]


async def test_reconfigure_drains_then_runs_arrivals_under_the_new_knobs(
        aiohttp_client: MakeClient) -> None:
    row = flat(endpoint_rows()["`POST /admin/reconfigure`"])
    assert "Requests arriving meanwhile wait, then run under the new knobs." in row
    engine, executor = gated_engine()
    client = await aiohttp_client(make_app(engine))
    steps: list[StepOutput] = []
    engine.add_observer(Recorder(steps))
    with gated(executor):
        first = asyncio.ensure_future(complete(client, max_tokens=200))
        await held_after(executor, 0)
        change = asyncio.ensure_future(client.post("/admin/reconfigure", json={
            "changes": {"max_num_batched_tokens": 32}}))
        await step_until(executor, lambda: engine.load()["reconfiguring"])
        assert (await (await client.get("/readyz")).json())["reconfiguring"] is True
        arriving = asyncio.ensure_future(complete(client, prompt_token_ids=list(range(1, 101))))
        await wait_for(lambda: engine.load()["waiting"] == 1)
    assert (await first).status == 200  # drained, not aborted
    assert (await change).status == 200
    assert (await arriving).status == 200
    prefills = [n for step in steps for n in step.scheduled.values() if n > 1]
    assert prefills[-4:] == [32, 32, 32, 4]  # the old budget (256) took the 100 tokens at once


async def test_reconfigure_with_abort_running_aborts_what_runs(aiohttp_client: MakeClient) -> None:
    engine, executor = gated_engine()
    client = await aiohttp_client(make_app(engine))
    with gated(executor):
        running = asyncio.ensure_future(complete(client, max_tokens=200))
        await held_after(executor, 0)
        change = asyncio.ensure_future(client.post("/admin/reconfigure", json={
            "changes": {"max_num_seqs": 4}, "abort_running": True}))
        await step_until(executor, lambda: engine.config.max_num_seqs == 4)
    answer = await running
    assert answer.status == 503 and (await answer.json())["error"]["code"] == "request_aborted"
    assert (await change).status == 200


# ---- errors --------------------------------------------------------------------------------------
async def error_of(answer: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert answer.status == status, await answer.text()
    error = (await answer.json())["error"]
    assert sorted(error) == ["code", "message", "param", "type"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


def errors_text() -> str:
    return flat(part("Errors"))


async def test_errors_use_openais_shape_with_the_codes_named(client: Client) -> None:
    said = errors_text()
    assert "`context_length_exceeded` when prompt + `max_tokens` > `max_model_len`" in said
    await error_of(await complete(client, max_tokens=250, prompt_token_ids=[1] * 10), 400,
                   "context_length_exceeded")
    fits = await complete(client, max_tokens=246, prompt_token_ids=[1] * 10)
    assert fits.status == 200  # prompt + max_tokens == max_model_len
    assert "404 `model_not_found`" in said
    await error_of(await complete(client, model="gpt-9"), 404, "model_not_found")
    await error_of(await complete(client, temperature=-1), 400)


async def test_a_body_over_4_mib_is_a_413(client: Client) -> None:
    assert "413 for bodies over 4 MiB" in errors_text()
    body = json.dumps({"prompt": "x" * (4 << 20)})
    await error_of(await client.post("/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}), 413)
    default = inspect.signature(make_app).parameters["client_max_size"].default
    assert default == 4 << 20


async def test_a_full_waiting_queue_is_503_engine_overloaded_with_retry_after(
        aiohttp_client: MakeClient) -> None:
    assert "503 `engine_overloaded` with `Retry-After`" in errors_text()
    assert "(`max_waiting_requests` / `max_waiting_tokens`)" in errors_text()
    engine, executor = gated_engine(max_waiting_requests=1, max_num_seqs=1)
    client = await aiohttp_client(make_app(engine))
    with gated(executor):
        busy = [asyncio.ensure_future(complete(client, max_tokens=5))]
        await held_after(executor, 0)
        await held_after(executor, 1)  # running, no longer pending
        busy.append(asyncio.ensure_future(complete(client)))
        await wait_for(lambda: engine.load()["waiting"] == 1)
        answer = await complete(client)
        await error_of(answer, 503, "engine_overloaded")
        assert int(answer.headers["Retry-After"]) >= 1
    assert [r.status for r in await asyncio.gather(*busy)] == [200, 200]
    stats = await (await client.get("/stats")).json()
    assert stats["rejections"]["by_reason"] == {"overloaded": 1}


async def test_max_waiting_tokens_bounds_the_queue_too() -> None:
    engine, executor = gated_engine(max_waiting_tokens=256, max_num_seqs=1)
    await engine.start()
    try:
        with gated(executor):
            running = asyncio.ensure_future(collect(engine.generate(
                "a", [1] * 10, SamplingParams(max_tokens=3))))
            await held_after(executor, 0)
            await held_after(executor, 1)
            waiting = asyncio.ensure_future(collect(engine.generate(
                "b", [1] * 200, SamplingParams(max_tokens=3))))
            await wait_for(lambda: engine.load()["waiting_tokens"] == 200)
            with pytest.raises(EngineOverloaded, match="max_waiting_tokens 256"):
                await anext(engine.generate("c", [1] * 100, SamplingParams(max_tokens=3)))
        await asyncio.gather(running, waiting)
    finally:
        await engine.shutdown()


# ---- keys and metrics ----------------------------------------------------------------------------
async def test_a_key_guards_v1_load_stats_and_admin_and_nothing_else(
        aiohttp_client: MakeClient) -> None:
    said = flat(part("`fairgate engine`: a standalone engine server"))
    assert "a bearer key on `/v1/*`, `/load`, `/stats` and `/admin/*`" in said
    app = make_app(AsyncEngine(sim_config()), access=EngineAccess(api_key=KEY))
    client = await aiohttp_client(app)
    keyed = {"/v1/models", "/load", "/stats", "/admin/config"}
    for method, path in sorted(served_routes(app)):
        if method != "GET":
            continue
        open_answer = await client.get(path)
        assert (open_answer.status == 401) == (path in keyed), path
        answer = await client.get(path, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status == 200, path
    refused = await client.post("/v1/completions", json={"prompt": "x"})
    assert refused.status == 401


async def test_metrics_are_fairgate_engine_with_model_name_and_vllms_names_with_compat(
        aiohttp_client: MakeClient) -> None:
    said = flat(part("Metrics"))
    assert "the `fairgate_engine_*` series (label `model_name`)" in said
    assert "with `metrics_compat: vllm`, vLLM's names for them" in said
    for compat in (None, "vllm"):
        client = await aiohttp_client(make_app(AsyncEngine(sim_config(
            metrics_compat=compat, served_model_name="named")))
        )
        assert (await complete(client)).status == 200
        families = list(text_string_to_metric_families(await (await client.get("/metrics")).text()))
        ours = [s for f in families if f.name.startswith("fairgate_engine_") for s in f.samples]
        assert ours and {s.labels.get("model_name") for s in ours} == {"named"}
        vllm = [f.name for f in families if f.name.startswith("vllm:")]
        assert bool(vllm) == (compat == "vllm")


# ---- the Python API ------------------------------------------------------------------------------
def api_text() -> str:
    return flat(part("Python API"))


def test_the_python_api_has_the_signatures_listed() -> None:
    said = api_text()
    assert "`AsyncEngine(config)` (or `AsyncEngine.from_engine(llm_engine)`)" in said
    generate = inspect.signature(AsyncEngine.generate).parameters
    assert list(generate)[1:4] == ["request_id", "prompt_token_ids", "params"]
    assert {"tenant", "priority"} <= set(generate)
    assert list(inspect.signature(AsyncEngine.abort).parameters)[1:] == ["request_id"]
    reconfigure = inspect.signature(AsyncEngine.reconfigure).parameters
    assert list(reconfigure)[1:3] == ["changes", "abort_running"]
    assert reconfigure["abort_running"].default is False
    window = inspect.signature(AsyncEngine.stats_window).parameters
    assert list(window)[1:] == ["window_s", "slo_ttft", "slo_tpot", "slo_itl"]
    for name in ("start", "abort", "reconfigure", "shutdown"):
        assert inspect.iscoroutinefunction(getattr(AsyncEngine, name)), name
    made = inspect.signature(make_app).parameters
    assert "`engine.server.make_app(engine, client_max_size=4 MiB, access=None)`" in said
    assert list(made) == ["engine", "client_max_size", "access"]
    assert (made["client_max_size"].default, made["access"].default) == (4 << 20, None)


async def test_the_python_api_generates_aborts_reconfigures_and_reports() -> None:
    llm = sim_engine()
    engine = AsyncEngine.from_engine(llm)
    assert engine.llm_engine is llm
    await engine.start()
    try:
        outs = await collect(engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=5),
                                             tenant="acme", priority="batch"))
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 5
        assert {"running", "waiting", "kv_usage"} <= set(engine.load())
        config = await engine.reconfigure({"max_num_seqs": 4}, abort_running=False)
        assert config.max_num_seqs == engine.config.max_num_seqs == 4
        window = engine.stats_window(60.0, slo_ttft=1e9, slo_tpot=1e9, slo_itl=1e9)
        assert window["goodput"]["requests"] == 1 and window["itl_attainment"]["fraction"] == 1.0
    finally:
        await engine.shutdown()


async def test_abort_ends_a_stream_with_abort() -> None:
    engine, executor = gated_engine()
    await engine.start()
    try:
        with gated(executor):
            stream = asyncio.ensure_future(collect(engine.generate(
                "r1", [1, 2, 3], SamplingParams(max_tokens=200))))
            await held_after(executor, 1)
            await engine.abort("r1")
        assert (await stream)[-1].finish_reason == "abort"
    finally:
        await engine.shutdown()


async def test_shutdown_ends_open_streams_with_abort() -> None:
    assert "`await shutdown()` (open streams end with `abort`)" in api_text()
    engine, executor = gated_engine()
    await engine.start()
    with gated(executor):
        stream = asyncio.ensure_future(collect(engine.generate(
            "r1", [1, 2, 3], SamplingParams(max_tokens=200))))
        await held_after(executor, 1)
        stopping = asyncio.ensure_future(engine.shutdown())
        await wait_for(lambda: not engine.is_running)
    await stopping
    assert (await stream)[-1].finish_reason == "abort"


# ---- kernels -------------------------------------------------------------------------------------
def kernel_table() -> dict[str, str]:
    return table(part("Kernels (`kernels/`)"))


def test_the_kernel_table_is_the_kernel_set() -> None:
    pytest.importorskip("torch")
    from kernels import KernelOps, get_ops, reference

    ops = [ticked(cell)[0] for cell in kernel_table()]
    assert sorted(ops) == sorted(f.name for f in fields(KernelOps))
    torch_ops = get_ops("torch")
    assert all(getattr(torch_ops, op) is getattr(reference, op) for op in ops)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_ops("cuda")


def test_each_triton_launcher_takes_its_references_arguments_and_the_extras_named() -> None:
    pytest.importorskip("triton")
    from kernels import reference, triton_ops

    said = sentence(part("Kernels (`kernels/`)"), "beside a PyTorch reference with the same")
    extras = {}
    for op in (ticked(cell)[0] for cell in kernel_table()):
        ours = inspect.signature(getattr(reference, op)).parameters
        theirs = inspect.signature(getattr(triton_ops, op)).parameters
        assert list(theirs)[:len(ours)] == list(ours), op
        extra = list(theirs.values())[len(ours):]
        assert all(p.default is not inspect.Parameter.empty for p in extra), op
        extras.update({p.name: op for p in extra})
    assert extras == {"num_splits": "paged_decode_attention"}
    assert "`paged_decode_attention` takes one more, optional argument, `num_splits`" in said


def test_auto_picks_triton_on_cuda_and_the_references_on_cpu(torch_engine: LLMEngine) -> None:
    from kernels import resolve_backend

    assert EngineConfig().attention_backend == "auto"
    assert resolve_backend("auto", "cpu") == "torch"
    assert runner(reconfigured(torch_engine)).attention_backend == "torch"
    pytest.importorskip("triton")
    assert resolve_backend("auto", "cuda") == "triton"


def test_the_cache_layout_per_layer(torch_engine: LLMEngine) -> None:
    said = flat(part("Kernels (`kernels/`)"))
    assert "`[num_blocks, block_size, num_kv_heads, head_dim]`" in said
    eng = reconfigured(torch_engine, num_kv_blocks=24)
    shape = runner(eng).model_config
    layer = runner(eng).kv_cache.layers[0]
    assert layer.k_cache.shape == layer.v_cache.shape == (24, 16, shape.num_kv_heads,
                                                         shape.head_dim)
    assert layer.k_scale is None


def test_launchers_check_shapes_before_launching() -> None:
    pytest.importorskip("triton")
    import torch

    from kernels import triton_ops

    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="k_cache must be"):
        triton_ops.store_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache[0], cache[0],
                            torch.zeros(3, dtype=torch.int64))


def test_the_kernel_contract_suite_covers_the_shapes_the_page_lists() -> None:
    pytest.importorskip("torch")
    from tests.kernels.conftest import IMPLEMENTATIONS
    from tests.kernels.test_contract import SHAPES

    said = flat(part("Kernels (`kernels/`)"))
    assert "(block sizes 16/32, head dims 64/128, GQA 1/4/8," in said
    shapes = [tuple(p.values) for p in SHAPES]
    assert {s[0] for s in shapes} == {16, 32} and {s[1] for s in shapes} == {64, 128}
    assert {s[2] for s in shapes} == {1, 4, 8}
    assert [p.values[0] for p in IMPLEMENTATIONS] == ["torch", "triton"]


def test_the_kernel_benchmark_without_a_gpu_says_so_and_exits_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    assert "Without a GPU it says so and exits 0." in flat(part("Kernels (`kernels/`)"))
    monkeypatch.setattr(sys, "argv", ["bench/kernels.py"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script edits it
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "bench" / "kernels.py"), run_name="__main__")
    assert exited.value.code == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
