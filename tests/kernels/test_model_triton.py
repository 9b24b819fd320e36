"""The tiny model gives the same greedy tokens with the Triton kernels as with the references.

A small token budget forces chunked prefill, so steps mix prefill chunks (paged_attention over a
cached prefix) with decodes, and prompts cross block boundaries.
"""

from __future__ import annotations

import pytest

from kernels import triton_interpreted

pytest.importorskip("triton")
engine = pytest.importorskip("engine", reason="the engine package is needed for this test")

PROMPTS = {
    "short": [1, 2, 3],
    "one-block": list(range(10, 26)),  # exactly one 16-token block
    "long": [(7 * i + 3) % 500 for i in range(45)],  # chunked over several steps
    "mid": [(11 * i) % 400 + 5 for i in range(21)],
}


def _generate(attention_backend: str, kv_cache_dtype: str) -> dict[str, list[int]]:
    config = engine.EngineConfig(
        model="random:tiny", executor="torch", device="cpu", dtype="float32",
        attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=24, max_num_seqs=8, max_model_len=128, num_kv_blocks=64,
        block_size=16, enable_prefix_caching=False)
    eng = engine.LLMEngine(config)
    params = engine.SamplingParams(max_tokens=8, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt_token_ids=prompt, params=params)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    finished: set[str] = set()
    for _ in range(200):
        out = eng.step()
        for rid, token in out.sampled.items():
            tokens[rid].append(token)
        finished.update(out.finished)
        if finished == set(PROMPTS):
            return tokens
    raise AssertionError(f"requests did not finish: {set(PROMPTS) - finished}")


@pytest.mark.skipif(not triton_interpreted(), reason="set TRITON_INTERPRET=1 to run Triton on CPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_triton_backend_matches_torch_greedy_tokens(kv_cache_dtype: str) -> None:
    expected = _generate("torch", kv_cache_dtype)
    assert all(len(t) == 8 for t in expected.values())
    assert _generate("triton", kv_cache_dtype) == expected
