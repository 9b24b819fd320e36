"""The fair-share cost: what serving a request adds to its tenant's virtual token counter (VTC).

One definition for both places that account service: the engine's `fair` policy
(engine.policies.FairShareQueue) and the gateway's dispatcher (gateway.fairqueue.FairQueue).
Both divide this cost by the tenant's weight, so a tenant's counter means the same in each.

An output token costs more than an input token: a prompt token is computed in a batched,
compute-bound prefill, while every output token takes a memory-bound decode step of its own.
The weights are the VTC paper's default (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): input 1, output 2.

How each side counts tokens:
- the engine charges a prefill chunk's computed tokens as input tokens (a prompt's, and after a
  preemption by recompute, the prompt and outputs run again) and every sampled token as an
  output token, as the step computes them;
- the gateway charges the request's prompt and estimated output tokens at dispatch and settles
  to the actual counts when the request finishes.
For a request that is never preempted both end at `cost(prompt tokens, output tokens)`.

Both lift a returning tenant's counter by one rule too (`lifted_counter`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protocol.validators import check_number

# A tenant's weight divides its request costs and is summed over tenants: outside this range
# the fair-share counters overflow to infinity or lose all precision. The tenant store, the
# engine extension `tenant_weight` and the OpenAPI document all bound it here.
WEIGHT_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class VTCCost:
    input_weight: float = 1.0  # per prompt (prefill) token
    output_weight: float = 2.0  # per output (decode) token

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight"):
            check_number(f"VTCCost.{name}", getattr(self, name), low=0, open_low=True)

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """Weighted service of `input_tokens` prefill tokens and `output_tokens` output tokens."""
        return self.input_weight * input_tokens + self.output_weight * output_tokens


VTC_COST = VTCCost()  # the cost every fair-share counter in fairgate charges


def lifted_counter(own: float, backlogged: Iterable[float], last_served: float | None) -> float:
    """The counter of a tenant that had no work backlogged and just got a request: VTC's lift
    (Sheng et al., Algorithm 2). No lower than the least-served backlogged tenant's counter, so
    time idle banks no credit to take all service with later; with no tenant backlogged, no
    lower than the counter of the tenant served last (below the counters of tenants served
    earlier, the newcomer would take all service when they come back). Never lower than its
    own: service it had is not forgotten. `backlogged`: the other tenants' counters (the engine
    counts a tenant with unfinished requests, whose running ones it still charges; the gateway
    one with queued requests, as it charges a request whole at dispatch)."""
    floor = min(backlogged, default=last_served)
    return own if floor is None else max(own, floor)
