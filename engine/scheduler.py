"""One step's plan: which requests run, how many tokens each, who is preempted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.clock import Clock
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.policies import make_waiting_queue
from engine.request import PRIORITIES, FinishReason, Request, RequestStatus

# fair: tenants far over their share add prefills to a step after its first only while the step's
# new prefill tokens stay within 1/8 of the token budget (at 2048: one 256-token prompt, or
# several short ones)
FAR_AHEAD_PREFILL_SHARE = 8


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # position of the first token computed this step (num_computed_tokens before it)
    num_tokens: int  # tokens computed this step
    # True when this step computes the request's last known token, so a token is sampled
    samples: bool = False


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_batched_tokens: int = 0

    @property
    def scheduled(self) -> dict[str, int]:
        return {s.request.request_id: s.num_tokens for s in self.requests}

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.swap_out and not self.swap_in


class Scheduler:
    """Builds each step's plan under the token budget, the sequence budget and free blocks,
    and applies the step's results. Order inside a step (stall-free batching): running decodes,
    then running partial prefills, then swapped requests, then new prefills in policy order."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Clock,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.resolved_max_model_len
        self.waiting = make_waiting_queue(config, self._cached_prefix_tokens)
        self.running: dict[str, Request] = {}  # admission order
        self.running_batch: dict[str, Request] = {}  # the running requests of priority batch
        self.swapped: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.live_per_tenant: dict[str, int] = {}
        self.num_preemptions = 0

    # ---- membership --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests
        self.requests[request.request_id] = request
        live = self.live_per_tenant.get(request.tenant, 0)
        if live == 0:
            self.waiting.activate(request.tenant, self.live_per_tenant.keys())
        self.live_per_tenant[request.tenant] = live + 1
        params, prompt = request.params, len(request.prompt_token_ids)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        request.stop_ids = eos.union(params.stop_token_ids) if params.stop_token_ids else eos
        request.stop_from = prompt + params.min_tokens
        request.token_limit = min(prompt + params.max_tokens, self.max_model_len)
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(self.config.max_num_batched_tokens)
        prefills = self._schedule_running(step)
        if not step.plan.preempted:
            swapped_in = self._schedule_swapped(step)
            # swapped work goes first: only waiting work that outranks all of it may pass
            self._schedule_waiting(step, prefills + swapped_in, outrank=min(
                (r.priority_rank for r in self.swapped.values()), default=len(PRIORITIES)))
        return step.plan

    def _schedule_running(self, step: _StepBuilder) -> list[Request]:
        """Schedule the running decodes, then the running prefills' next chunks, each in
        admission order. Returns the running prefills."""
        prefills: list[Request] = []
        block_size = self.kv.block_size
        # Every decode fits the token budget (max_num_batched_tokens >= max_num_seqs).
        for request in list(self.running.values()):  # a copy: preempting removes from running
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room
            if request.num_tokens - request.num_computed_tokens > 1:
                prefills.append(request)
            elif request.num_tokens <= len(request.block_ids) * block_size:
                step.add_decode(request)  # the common case: room left in its last block
            elif self._allocate_or_preempt(request, 1, step):
                step.add(request, 1)
        for request in prefills:
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            num_tokens = self._chunk(request, step.budget)
            if self._allocate_or_preempt(request, num_tokens, step):
                step.add(request, num_tokens)
        return prefills

    def _allocate_or_preempt(self, request: Request, num_tokens: int, step: _StepBuilder) -> bool:
        while not self.kv.allocate(request, num_tokens):
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _pick_victim(self, batch_only: bool = False) -> Request:
        """Lowest priority class first, then the latest arrival."""
        candidates = self.running_batch if batch_only else self.running
        return max(candidates.values(), key=lambda r: (r.priority_rank, r.arrival_time, r.seq))

    def _schedule_swapped(self, step: _StepBuilder) -> list[Request]:
        """Swap requests back in, the reverse of the victim order: interactive work first, then
        the earliest arrival. Returns those swapped in."""
        swapped_in: list[Request] = []
        for request in sorted(self.swapped.values(),
                              key=lambda r: (r.priority_rank, r.arrival_time, r.seq)):
            if step.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            num_tokens = self._chunk(request, step.budget)
            computed = self.kv.blocks_needed(request.num_computed_tokens + num_tokens)
            if computed > self.kv.num_free_blocks:
                break
            step.plan.swap_in.extend(self.kv.swap_in(request))
            assert self.kv.allocate(request, num_tokens)
            del self.swapped[request.request_id]
            self._start_running(request)
            step.add(request, num_tokens)
            swapped_in.append(request)
        return swapped_in

    def _schedule_waiting(self, step: _StepBuilder, maybe_partial: list[Request],
                          outrank: int) -> None:
        """Admit waiting requests in policy order; only those ranked below `outrank` (a
        priority rank) may pass a request that could not get in. `maybe_partial`: the running
        requests that may be partial prefills (the others are decodes, never partial)."""
        partial = sum(1 for r in maybe_partial if r.status is RequestStatus.RUNNING
                      and r.is_prefill and not step.completes(r))
        # fair: new prefills of tenants far over their share open a step or join one while the
        # step's new prefill tokens stay within this cap, never a step that starts a tenant
        # behind them (it would wait longer for its first token)
        far_tenants = self.waiting.far_ahead_tenants(self.live_per_tenant.keys())
        far_cap = self.config.max_num_batched_tokens // FAR_AHEAD_PREFILL_SHARE
        new_tokens, far_closed = 0, False
        for request in self.waiting.ordered(self.clock.now()):
            if step.budget == 0 or outrank == 0:
                break
            far = request.tenant in far_tenants
            if request.priority_rank >= outrank or (far and far_closed):
                continue
            cached = self.kv.cached_prefix(request)
            remaining = request.num_remaining_tokens - len(cached) * self.kv.block_size
            num_tokens = self._chunk_tokens(remaining, step.budget)
            if far and new_tokens and new_tokens + num_tokens > far_cap:
                far_closed = True
                continue
            is_partial = num_tokens < remaining
            if is_partial and partial >= self.config.max_num_partial_prefills:
                continue  # one partial prefill too many: let requests that finish their prompt by
            if not self._make_room(request, num_tokens, cached, step):
                # head of line: smaller requests behind must not starve a large one, but
                # interactive work behind blocked batch work may still preempt running batch
                outrank = request.priority_rank
                continue
            self.waiting.remove(request)
            new_tokens += num_tokens
            far_closed |= not far  # a tenant behind started here: keep this step short
            self.kv.note_admission(request, len(cached))
            partial += is_partial
            step.admitted[request.request_id] = request.first_scheduled_time
            self._start_running(request)
            step.add(request, num_tokens)

    def _make_room(self, request: Request, num_tokens: int, cached: list[int],
                   step: _StepBuilder) -> bool:
        """Take a seat and blocks for a waiting request; interactive work may preempt running
        batch work for either (large engines let batch work hold every seat)."""
        if len(self.running) >= self.config.max_num_seqs and not self._evict_batch_for(
                request, step, lambda: len(self.running) < self.config.max_num_seqs):
            return False
        if self.kv.allocate(request, num_tokens, cached):
            return True
        # Preempt only when the batch work's own blocks can cover the shortfall: otherwise the
        # victims would lose their progress and the request would still not fit.
        if self.kv.exclusive_blocks(self.running_batch.values()) < self.kv.shortfall(request, num_tokens, cached):
            return False
        return self._evict_batch_for(
            request, step, lambda: self.kv.can_allocate(request, num_tokens, cached)
        ) and self.kv.allocate(request, num_tokens, cached)

    def _evict_batch_for(self, request: Request, step: _StepBuilder,
                         fits: Callable[[], bool]) -> bool:
        """Preempt running batch requests, latest first, until `fits()`; only for interactive
        requests. The victims' blocks go back now, their freed seats at once."""
        if request.priority != "interactive":
            return False
        while self.running_batch:
            self._preempt(self._pick_victim(batch_only=True), step)
            if fits():
                return True
        return fits()

    def _chunk(self, request: Request, budget: int) -> int:
        return self._chunk_tokens(request.num_remaining_tokens, budget)

    def _chunk_tokens(self, remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold and remaining > 1:
            remaining = min(remaining, threshold)
        return min(remaining, budget)

    def _cached_prefix_tokens(self, request: Request) -> int:
        return len(self.kv.cached_prefix(request)) * self.kv.block_size

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        if request.request_id in step.admitted:
            self._unadmit(request, step)
            return
        step.remove(request)
        self._stop_running(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        step.plan.preempted.append(request.request_id)
        mapping = self.kv.swap_out(request) if self.config.preemption == "swap" else None
        if mapping is not None:
            step.plan.swap_out.extend(mapping)
            request.status = RequestStatus.SWAPPED
            self.swapped[request.request_id] = request
            return
        self._back_to_waiting(request)  # recompute

    def _unadmit(self, request: Request, step: _StepBuilder) -> None:
        """Put a request admitted earlier in this step back where it waited, as if it had not
        been (an interactive request behind it in a policy's order took its seat or blocks):
        it never ran, so it is no preemption, and its first scheduling is still to come."""
        step.remove(request)
        self._stop_running(request)
        request.first_scheduled_time = step.admitted.pop(request.request_id)
        self.kv.forget_admission(request)
        self._back_to_waiting(request)

    def _back_to_waiting(self, request: Request) -> None:
        """Its blocks freed (cached full blocks stay in the prefix cache), to compute again."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running[request.request_id] = request
        if request.priority == "batch":
            self.running_batch[request.request_id] = request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock.now()

    def _stop_running(self, request: Request) -> None:
        del self.running[request.request_id]
        self.running_batch.pop(request.request_id, None)

    # ---- results ------------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, sampled: dict[str, int]) -> StepResult:
        """Advance every scheduled request by its computed tokens and append sampled tokens.
        `sampled` (request id -> token, from the executor) becomes the result's own `sampled`,
        less the tokens of requests aborted while the step ran: no dict or list per request is
        built for it (at 1,024 running, a step's data already outgrows a core's cache)."""
        result = StepResult(sampled)
        now = self.clock.now()
        block_size = self.kv.block_size
        charge = self.waiting.charge if self.waiting.accounts_service else None
        for scheduled in plan.requests:
            request = scheduled.request
            if request.status is not RequestStatus.RUNNING:
                sampled.pop(request.request_id, None)  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduled.num_tokens
            if request.num_computed_tokens // block_size > request.num_committed_blocks:
                self.kv.commit(request)  # a block filled up: publish it to the prefix cache
            if charge is not None:
                charge(request, scheduled.num_tokens)
            if not scheduled.samples:
                continue
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output(token, now)
            # the stop check, from the request's own fields (see `add`)
            if token in request.stop_ids and request.num_tokens >= request.stop_from:
                reason = FinishReason.STOP
            elif request.num_tokens >= request.token_limit:
                reason = FinishReason.LENGTH
            else:
                continue
            self._finish(request, reason)
            result.finished[request.request_id] = reason
        return result

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a request from outside the step (a stop string, an error)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._stop_running(request)
        elif request.status is RequestStatus.SWAPPED:
            del self.swapped[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock.now()
        del self.requests[request.request_id]
        live = self.live_per_tenant[request.tenant] - 1
        if live:
            self.live_per_tenant[request.tenant] = live
        else:
            del self.live_per_tenant[request.tenant]

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        held = {b for r in self.requests.values() for b in r.block_ids}
        used = {b for b, c in enumerate(self.kv.pool.ref_counts) if c > 0}
        assert held == used, f"leaked blocks: {sorted(used - held)[:10]}"
        assert len(self.running) <= self.config.max_num_seqs
        assert self.running_batch == {
            i: r for i, r in self.running.items() if r.priority == "batch"}, "running_batch stale"
        assert len(self.running) + len(self.swapped) + len(self.waiting) == len(self.requests)


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> its token this step
    finished: dict[str, FinishReason] = field(default_factory=dict)


class _StepBuilder:
    """The plan under construction and the token budget it has left."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.plan = SchedulerOutput()
        self._index: dict[str, ScheduledRequest] = {}
        # admitted from waiting in this step: request id -> its first_scheduled_time before
        self.admitted: dict[str, float | None] = {}

    def add(self, request: Request, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.budget
        start = request.num_computed_tokens
        scheduled = ScheduledRequest(request, start, num_tokens,
                                     samples=start + num_tokens == request.num_tokens)
        self.plan.requests.append(scheduled)
        self._index[request.request_id] = scheduled
        self.budget -= num_tokens
        self.plan.num_batched_tokens += num_tokens

    def add_decode(self, request: Request) -> None:
        """add(request, 1) for a request with one token to compute (it samples). Decodes stay
        out of the index: `completes` asks only about prefills, and `remove` finds them."""
        assert self.budget > 0
        self.plan.requests.append(ScheduledRequest(request, request.num_computed_tokens, 1, True))
        self.budget -= 1
        self.plan.num_batched_tokens += 1

    def completes(self, request: Request) -> bool:
        """Scheduled this step through its last known token (asked of prefills only)."""
        scheduled = self._index.get(request.request_id)
        return scheduled is not None and scheduled.samples

    def remove(self, request: Request) -> None:
        """Take back a request scheduled earlier in this step (it is being preempted)."""
        scheduled = self._index.pop(request.request_id, None) or next(
            (s for s in self.plan.requests if s.request is request), None)
        if scheduled is not None:
            self.plan.requests.remove(scheduled)
            self.budget += scheduled.num_tokens
            self.plan.num_batched_tokens -= scheduled.num_tokens
