"""The vectorised sampler: greedy, temperature, top-k/p, min-p, seeds, penalties, logprobs."""

from __future__ import annotations

import torch

from engine import Request, SamplingParams
from engine.sampling import SamplingBatch, sample, stateless_uniform

CPU = torch.device("cpu")


def requests(*params: SamplingParams, outputs: list[list[int]] | None = None,
             prompt: list[int] | None = None) -> list[Request]:
    out = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", list(prompt or [0]), p)
        r.output_token_ids = list(outputs[i]) if outputs else []
        out.append(r)
    return out


def draw(logits: torch.Tensor, reqs: list[Request], seed: int = 0) -> list[int]:
    batch = SamplingBatch.build(reqs, logits.shape[1], seed, CPU)
    return sample(logits, batch).token_ids


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50)
    assert draw(logits, requests(*[SamplingParams()] * 5)) == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4000)]
    counts = torch.bincount(torch.tensor(draw(logits, requests(*params))), minlength=4)
    torch.testing.assert_close(counts / 4000, logits[0].softmax(-1), atol=0.03, rtol=0)


def test_seeded_draws_are_stateless_and_reproducible():
    logits = torch.randn(1, 100).repeat(3, 1)
    params = SamplingParams(temperature=1.0, seed=7)
    first = draw(logits, requests(params, params, params))
    assert first[0] == first[1] == first[2]  # same seed and step, any row
    assert draw(logits, requests(params, params, params)) == first
    later = [draw(logits[:1], requests(params, outputs=[[1] * n]))[0] for n in range(20)]
    assert len(set(later)) > 3  # the step changes the draw


def test_unseeded_requests_differ_but_replay_under_the_same_engine_seed():
    logits = torch.zeros(2, 1000)
    reqs = requests(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0))
    tokens = draw(logits, reqs, seed=0)
    assert tokens[0] != tokens[1]
    assert draw(logits, reqs, seed=0) == tokens


def test_top_k_top_p_and_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(600, 1)
    cases = {
        "top_k": (dict(top_k=2), {0, 1}),
        "top_p": (dict(top_p=0.7), {0, 1}),  # 0.5 + 0.3 covers 0.7
        "min_p": (dict(min_p=0.5), {0, 1}),  # >= 0.5 * 0.5
        "top_k_top_p": (dict(top_k=3, top_p=0.55), {0, 1}),
    }
    for name, (knobs, support) in cases.items():
        params = [SamplingParams(temperature=1.0, seed=s, **knobs) for s in range(600)]
        assert set(draw(logits, requests(*params))) == support, name


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(2, 30)
    tokens = draw(logits, requests(SamplingParams(), SamplingParams(temperature=1.0, seed=1)))
    assert tokens[0] == int(logits[0].argmax())


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 40)
    prompt, output = [3, 5, 7], [5, 11]
    params = SamplingParams(repetition_penalty=1.7)
    batch = SamplingBatch.build(requests(params, outputs=[output], prompt=prompt), 40, 0, CPU)
    assert batch.penalties is not None
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]),
                                                     logits.clone())
    torch.testing.assert_close(batch.penalties.apply(logits), expected)


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.zeros(1, 10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    batch = SamplingBatch.build(requests(params, outputs=[[2, 2, 4]], prompt=[6]), 10, 0, CPU)
    assert batch.penalties is not None
    penalised = batch.penalties.apply(logits)[0]
    assert penalised[2].item() == -(0.5 + 2 * 0.25)
    assert penalised[4].item() == -(0.5 + 0.25)
    assert penalised[6].item() == 0.0  # the prompt does not count
    greedy = draw(torch.tensor([[1.0, 0.0, 1.2]]), requests(
        SamplingParams(presence_penalty=1.0), outputs=[[2]]))
    assert greedy == [0]


def test_no_penalty_batch_skips_the_work():
    assert SamplingBatch.build(requests(SamplingParams()), 10, 0, CPU).penalties is None


def test_logprobs_are_the_model_distribution():
    logits = torch.randn(2, 20)
    reqs = requests(SamplingParams(logprobs=3), SamplingParams())
    result = sample(logits, SamplingBatch.build(reqs, 20, 0, CPU))
    lp = result.logprobs[0]
    assert lp is not None and result.logprobs[1] is None
    expected = logits[0].log_softmax(-1)
    assert list(lp)[0] == result.token_ids[0] and len(lp) == 3  # the sampled token is the top
    for token, value in lp.items():
        assert abs(value - expected[token].item()) < 1e-5
    zero = sample(logits, SamplingBatch.build(requests(SamplingParams(logprobs=0)), 20, 0, CPU))
    assert zero.logprobs[0] is not None and list(zero.logprobs[0]) == [zero.token_ids[0]]


def test_stateless_uniform_is_uniform_and_in_range():
    u = stateless_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 50_000)
    assert bool((u > 0).all() and (u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(u, stateless_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 50_000))
    assert not torch.equal(u[0], u[1])
