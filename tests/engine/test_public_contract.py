"""The engine's public Python contract as DESIGN.md writes it: the names tests, benchmarks and
other tools rely on. Issue 28's scheduler work renamed the step's tokens (`sampled`, one token
per request); `out.outputs`, the contract's spelling, must still read them."""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import FinishReason


def design_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:tiny", executor="sim", max_num_batched_tokens=4096,
                                  max_num_seqs=256, max_model_len=32768, num_kv_blocks=None))


def test_the_contract_runs_as_written_and_outputs_are_the_requests_tokens() -> None:
    eng = design_engine()
    requests = {rid: eng.add_request(rid, prompt_token_ids=list(range(1, 5 + 40 * i)),
                                     params=SamplingParams(max_tokens=16 + i), tenant="acme",
                                     priority="interactive")
                for i, rid in enumerate(("r1", "r2", "r3"))}
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    finished: dict[str, FinishReason] = {}
    while eng.has_unfinished():
        out = eng.step()
        assert set(out.outputs) <= set(out.scheduled)  # a request's tokens come from its step
        for rid, tokens in out.outputs.items():
            assert len(tokens) == 1 and tokens == [out.sampled[rid]]
            got[rid].extend(tokens)
        finished.update(out.finished)
    for i, (rid, request) in enumerate(requests.items()):
        assert got[rid] == request.output_token_ids and len(got[rid]) == 16 + i
    assert finished == dict.fromkeys(requests, FinishReason.LENGTH)
    stats = eng.stats()
    assert (stats["running"], stats["waiting"], stats["swapped"]) == (0, 0, 0)
    assert stats["free_blocks"] == stats["num_blocks"] and stats["kv_usage"] == 0


def test_abort_as_written_returns_the_blocks() -> None:
    eng = design_engine()
    eng.add_request("r1", prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(max_tokens=16),
                    tenant="acme", priority="interactive")
    out = eng.step()
    assert out.outputs.keys() == {"r1"} and eng.stats()["running"] == 1
    assert eng.abort("r1") and not eng.abort("r1")  # a second abort of it is a no-op
    stats = eng.stats()
    assert stats["running"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    assert eng.step().outputs == {}  # nothing left to run: an empty step
