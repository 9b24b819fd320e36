"""Requests, their sampling parameters and their states."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.priority import PRIORITIES, PRIORITY_RANK  # noqa: F401 - PRIORITIES re-exported
from protocol.validators import check_int, check_number, check_positive_int


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on detokenised text by the async engine
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives to return with each token

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, (list, str)):
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            object.__setattr__(self, "stop", stop)
        check_positive_int("max_tokens", self.max_tokens)
        check_int("top_k", self.top_k, low=0)
        check_int("min_tokens", self.min_tokens, low=0)
        check_number("temperature", self.temperature, 0.0, 100.0)
        check_number("top_p", self.top_p, 0.0, 1.0, open_low=True)
        check_number("min_p", self.min_p, 0.0, 1.0)
        check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, open_low=True)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            check_int("seed", self.seed, low=-(2**63), high=2**63 - 1)  # an int64 tensor
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0, high=20)
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids[]", token_id, low=0)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue: new, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: blocks held in host memory
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False, slots=True)  # slots: the scheduler reads every running request every step
class Request:
    """One generation. Token accounting is unified: the request always wants to compute
    `num_tokens - num_computed_tokens` tokens; when a step computes the last known token,
    a new token is sampled. A decode is that with one token left; a preempted-by-recompute
    request simply has `num_computed_tokens` reset to 0."""

    # The fields a step reads for every running request come first, so that they share the
    # object's first cache lines (the order of the slots): at 1,024 running requests a step's
    # data no longer fits a core's cache, and each cold line is a miss per request per step.
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_tokens: int = field(init=False, default=0)  # prompt + outputs, maintained on append
    block_ids: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks already published to the prefix cache
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    first_token_time: float | None = None
    # when a sampled token ends the request, from `params` and the engine (set by the scheduler's
    # add, so that the step does not read `params`): a token in `stop_ids` once `num_tokens`
    # reaches `stop_from` (min_tokens), or `num_tokens` reaching `token_limit` (max_tokens,
    # max_model_len)
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    stop_from: int = field(init=False, default=0)
    token_limit: int = field(init=False, default=0)
    tenant: str = ""
    priority: str = "interactive"
    arrival_time: float = 0.0
    seq: int = 0  # admission order, a tie-breaker that never repeats
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of full blocks, memoised
    num_preemptions: int = 0
    # timestamps (engine clock)
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # kept as a plain attribute for the same reason
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_remaining_tokens > 1

    @property
    def priority_rank(self) -> int:
        return PRIORITY_RANK[self.priority]

    def token_id(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    def estimated_remaining_work(self) -> int:
        """Tokens of work left: prefill still to compute plus outputs still to generate. The
        last sampled token is not prefill: running it through the model is how the next output
        comes, so it counts once, as an output left."""
        prefill_left = self.num_remaining_tokens - (1 if self.output_token_ids else 0)
        return prefill_left + self.params.max_tokens - self.num_output_tokens
