"""LLMEngine: the synchronous core. add_request / step / abort / stats."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from engine.clock import Clock, RealClock, VirtualClock
from engine.config import EngineConfig
from engine.executor import Executor, KVCapacity, make_executor
from engine.kv_cache import KVCacheManager
from engine.policies import FairShareQueue
from engine.request import PRIORITIES, FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler
from protocol.fairness import WEIGHT_RANGE

logger = logging.getLogger("fairgate.engine")

# stats() keys that count since the engine started, across reconfigure()
CUMULATIVE_COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


@dataclass
class StepOutput:
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    # request id -> the token it sampled this step (one at most: a step samples once per request)
    sampled: dict[str, int] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    num_batched_tokens: int = 0
    step_time: float = 0.0

    @property
    def outputs(self) -> dict[str, list[int]]:
        """request id -> the token ids it got this step: the public contract's spelling
        (DESIGN.md's `out.outputs`), built from `sampled` only when read. The step itself
        keeps one token per request and builds no list (issue 28's scheduler work)."""
        return {request_id: [token] for request_id, token in self.sampled.items()}


def _check_weight(weight: object) -> float:
    """`weight` as a float; ValueError unless it is a number within protocol.fairness'
    WEIGHT_RANGE (the range the tenant store and the gateway hold weights to)."""
    low, high = WEIGHT_RANGE
    try:
        value = float(weight) if isinstance(weight, (int, float)) else math.nan
    except OverflowError:  # an int too large for a float
        value = math.inf
    if isinstance(weight, bool) or not low <= value <= high:
        raise ValueError(f"tenant weights must be numbers in [{low:g}, {high:g}], "
                         f"got {weight!r:.40}")
    return value


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 clock: Clock | None = None) -> None:
        self.clock: Clock = clock or _default_clock(config)
        self.executor = executor or make_executor(config, self.clock)
        # the engine runs on max_model_len resolved against the model's context (a new config)
        self.config = config = config.with_context_length(self.executor.max_position)
        self.tokenizer = self.executor.tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(getattr(self.executor, "eos_token_ids", ()))
        self._seq = itertools.count()
        self.tenant_weights: dict[str, float] = {}
        self.num_steps = 0
        # counters of the schedulers that reconfigure() replaced, so stats() reports totals
        self._retired_counters = dict.fromkeys(CUMULATIVE_COUNTERS, 0)
        self.scheduler = self._build_scheduler(config)

    def _build_scheduler(self, config: EngineConfig) -> Scheduler:
        capacity: KVCapacity = self.executor.plan_kv_capacity(config)
        self.executor.allocate_kv_cache(config, capacity)
        self.capacity = capacity
        kv = KVCacheManager(capacity.num_blocks, config.block_size, config.enable_prefix_caching,
                            capacity.num_host_blocks)
        tokens = capacity.num_blocks * config.block_size
        max_model_len = config.resolved_max_model_len
        logger.debug("KV cache: %d blocks, %d tokens; max concurrency at max_model_len %d: %.1fx",
                    capacity.num_blocks, tokens, max_model_len, tokens / max_model_len)
        return Scheduler(config, kv, self.clock, self.eos_token_ids)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, tenant: str = "",
                    priority: str = "interactive", arrival_time: float | None = None,
                    tenant_weight: float | None = None) -> Request:
        """Queue a request. Bad input raises ValueError and leaves the engine unchanged.

        `tenant_weight`, when given, becomes the tenant's fair-share weight (as with
        `set_tenant_weights`; the latest request's weight wins)."""
        params = params or SamplingParams()
        self._validate(request_id, prompt_token_ids, params, tenant, priority)
        if tenant_weight is not None:
            weight = _check_weight(tenant_weight)
            if self.tenant_weights.get(tenant) != weight:
                self.tenant_weights[tenant] = weight
                self._apply_tenant_weights()
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          params=params, tenant=tenant, priority=priority,
                          arrival_time=self.clock.now() if arrival_time is None else arrival_time,
                          seq=next(self._seq))
        self.scheduler.add(request)
        return request

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams,
                  tenant: str, priority: str) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is "
                             "still running")
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {type(tenant).__name__}")
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; use one of: {', '.join(PRIORITIES)}")
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.executor.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        limit = self.config.resolved_max_model_len
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({limit}); shorten the prompt or lower max_tokens")

    def abort(self, request_id: str) -> bool:
        """End a request with reason abort, returning its blocks. Unknown ids are a no-op."""
        return self.scheduler.abort(request_id) is not None

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> None:
        self.scheduler.finish(request_id, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Fair-share weights for the `fair` policy (default weight 1)."""
        checked = {tenant: _check_weight(w) for tenant, w in weights.items()}
        self.tenant_weights.update(checked)
        self._apply_tenant_weights()

    def _apply_tenant_weights(self) -> None:
        queue = self.scheduler.waiting
        if isinstance(queue, FairShareQueue):
            queue.weights.update(self.tenant_weights)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> StepOutput:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return StepOutput(preempted=plan.preempted)
        model_output = self.executor.execute(plan)
        result = self.scheduler.update(plan, model_output.sampled)
        self.num_steps += 1
        return StepOutput(scheduled=plan.scheduled, sampled=result.sampled,
                          finished=result.finished, preempted=plan.preempted,
                          logprobs=model_output.logprobs,
                          num_batched_tokens=plan.num_batched_tokens,
                          step_time=model_output.step_time)

    def stats(self) -> dict[str, Any]:
        scheduler, kv = self.scheduler, self.scheduler.kv
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "swapped": len(scheduler.swapped),
            "kv_usage": kv.usage,
            "num_blocks": kv.num_blocks,
            "free_blocks": kv.num_free_blocks,
            **self._counter_totals(),
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "max_num_seqs": self.config.max_num_seqs,
        }

    def _counter_totals(self) -> dict[str, int]:
        """Cumulative counters: the live scheduler's plus those of every scheduler it replaced."""
        scheduler, kv = self.scheduler, self.scheduler.kv
        live = {"num_preemptions": scheduler.num_preemptions,
                "prefix_cache_queries": kv.prefix_cache_queries,
                "prefix_cache_hits": kv.prefix_cache_hits}
        return {key: self._retired_counters[key] + live[key] for key in CUMULATIVE_COUNTERS}

    # ---- reconfiguration ---------------------------------------------------------------------
    def reconfigure(self, config: EngineConfig) -> None:
        """Rebuild the scheduler and KV pool under a new config, keeping the loaded weights.
        Only allowed with no unfinished requests (the caller drains or aborts first)."""
        if self.has_unfinished():
            raise RuntimeError("reconfigure needs an idle engine: drain or abort requests first")
        self.check_reconfigurable(config)
        config = config.with_context_length(self.executor.max_position)
        totals = self._counter_totals()
        self.scheduler = self._build_scheduler(config)  # a failure keeps the old scheduler
        self._retired_counters = totals
        self.config = config
        self._apply_tenant_weights()  # weights outlive the scheduler they were given to

    def check_reconfigurable(self, config: EngineConfig) -> None:
        """ValueError if `config` changes a knob that needs a restart (weights, device, clock);
        lets callers refuse a reconfiguration before draining for it."""
        fixed = ("model", "served_model_name", "executor", "device", "dtype", "seed",
                 "sim_model", "sim_hardware", "sim_clock", "sim_profile", "attention_backend",
                 "metrics_compat")  # the series are registered once, at start
        changed = [k for k in fixed if getattr(config, k) != getattr(self.config, k)]
        if changed:
            raise ValueError(f"cannot change {', '.join(changed)} without a restart")


def _default_clock(config: EngineConfig) -> Clock:
    if config.executor == "sim" and config.sim_clock == "virtual":
        return VirtualClock()
    return RealClock()
