"""Token sampling, vectorised over the batch: penalties, temperature, min-p, top-k, top-p.

Randomness is stateless: a row's noise is a hash of (seed, number of output tokens so far,
token id), so a request preempted and recomputed draws exactly the same tokens again, on any
device and in any batch. A request without a seed gets one from (engine seed, request id).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from engine.request import Request

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors (rows: the requests that sample this step)."""

    temperature: torch.Tensor  # [num_rows] float32 (0: greedy)
    top_k: torch.Tensor  # [num_rows] int64 (vocab size: off)
    top_p: torch.Tensor  # [num_rows] float32
    min_p: torch.Tensor  # [num_rows] float32
    seeds: torch.Tensor  # [num_rows] int64
    steps: torch.Tensor  # [num_rows] int64, output tokens so far
    penalties: PenaltyBatch | None  # None: no row uses a penalty
    num_logprobs: list[int | None]
    all_greedy: bool
    needs_top_k_top_p: bool
    needs_min_p: bool

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, engine_seed: int,
              device: torch.device) -> SamplingBatch:
        params = [r.params for r in requests]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            seeds=torch.tensor([request_seed(r, engine_seed) for r in requests], device=device),
            steps=torch.tensor([r.num_output_tokens for r in requests], device=device),
            penalties=PenaltyBatch.build(requests, vocab_size, device),
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(p.greedy for p in params),
            needs_top_k_top_p=any(p.top_p < 1.0 or 0 < p.top_k < vocab_size for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
        )


def request_seed(request: Request, engine_seed: int) -> int:
    if request.params.seed is not None:
        return request.params.seed
    return _signed64(engine_seed * 0x9E3779B97F4A7C15 + zlib.crc32(request.request_id.encode()))


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class PenaltyBatch:
    output_counts: torch.Tensor  # [num_rows, vocab] float32: occurrences in the output
    seen: torch.Tensor  # [num_rows, vocab] bool: in prompt or output (repetition penalty)
    presence: torch.Tensor  # [num_rows, 1]
    frequency: torch.Tensor  # [num_rows, 1]
    repetition: torch.Tensor  # [num_rows, 1]

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int,
              device: torch.device) -> PenaltyBatch | None:
        params = [r.params for r in requests]
        if all(p.presence_penalty == 0 and p.frequency_penalty == 0
               and p.repetition_penalty == 1 for p in params):
            return None
        counts = _token_counts([r.output_token_ids for r in requests], vocab_size, device)
        prompts = _token_counts([r.prompt_token_ids for r in requests], vocab_size, device)
        return cls(
            output_counts=counts,
            seen=(counts + prompts) > 0,
            presence=_column([p.presence_penalty for p in params], device),
            frequency=_column([p.frequency_penalty for p in params], device),
            repetition=_column([p.repetition_penalty for p in params], device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # repetition (HF/CTRL): shrink positive logits, grow negative ones, of every seen token
        penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, penalised, logits)
        # presence/frequency (OpenAI): subtract over the output tokens only
        return logits - self.frequency * self.output_counts - self.presence * (
            self.output_counts > 0)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [num_rows, 1]


def _token_counts(token_lists: list[list[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] float32 count of each token id in each row's list."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)  # last: padding bin
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [num_rows, vocab] float32 -> one token per row (and logprobs where asked)."""
    raw_logits = logits
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    greedy_tokens = logits.argmax(dim=-1)  # [num_rows]
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        random_tokens = _sample_random(logits, batch)
        tokens = torch.where(batch.temperature == 0, greedy_tokens, random_tokens)
    return SamplerOutput(tokens.tolist(), _logprobs(raw_logits, tokens, batch.num_logprobs))


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temperature = batch.temperature.clamp_min(1e-5).unsqueeze(1)  # [num_rows, 1]
    probs = torch.softmax(logits / temperature, dim=-1)  # [num_rows, vocab]
    if batch.needs_min_p:
        floor = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    if batch.needs_top_k_top_p:
        probs = _top_k_top_p(probs, batch.top_k, batch.top_p)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws a token with probability p / sum(p)
    noise = -torch.log(stateless_uniform(batch.seeds, batch.steps, probs.shape[1]))
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's top-k and outside its top-p nucleus."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [num_rows, vocab]
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    sorted_probs = sorted_probs.masked_fill(rank >= top_k.unsqueeze(1), 0.0)
    # the nucleus is taken within the top-k; the most likely token always stays
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    total = sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(1) * total, 0.0)
    return probs.scatter(1, order, sorted_probs)


def stateless_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab] uniform noise in (0, 1), a pure function of (seed, step, token id)."""
    gamma = _signed64(0x9E3779B97F4A7C15)  # splitmix64's counter increment
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    row_key = _mix64(seeds * gamma + _mix64(steps))  # [num_rows]
    bits = _mix64(row_key.unsqueeze(1) + token_ids.unsqueeze(0) * gamma)  # [num_rows, vocab]
    mantissa = _shift_right(bits, 40).to(torch.float32)  # 24 random bits
    return (mantissa + 0.5) * 2.0**-24


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    x = x ^ _shift_right(x, 30)
    x = x * _signed64(0xBF58476D1CE4E5B9)
    x = x ^ _shift_right(x, 27)
    x = x * _signed64(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
    """The model's log-probabilities (before penalties and temperature) of the sampled token
    and of each row's top `logprobs` alternatives."""
    if all(k is None for k in num_logprobs):
        return [None] * len(num_logprobs)
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
    max_k = max(k or 0 for k in num_logprobs)
    top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    result: list[dict[int, float] | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            result.append(None)
            continue
        entry = {int(tokens[row]): chosen[row]}
        if k and top_ids is not None and top_values is not None:
            entry.update(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist(), strict=True))
        result.append(entry)
    return result
