"""Where dispatched requests run: the embedded AsyncEngine or remote engines over HTTP.

A backend answers four questions for the dispatcher and the proxy: how many tokens is this
prompt (`count_prompt`), is there room for one more request (`has_room`, from the engine's load
so that queueing happens in the gateway, where fairness applies; a shared engine's room counts
other gateways' requests on it), how loaded is it (`outstanding_tokens`: its queued and running
work, what least-loaded routing weighs), and run this job (`stream` / `complete`). Both kinds
emit OpenAI bytes; the proxy never reformats them.

A backend that fails before any byte of an answer reached the client (`BackendFailed`: the
connection refused, reset or hung up, or a 5xx that is not overload) lets the proxy hand the
request to another replica, once, within the retry budget (gateway/dispatch.py).

The parts, one module each:

    base        Job, Outcome, the Backend protocol, the errors, room from an engine's load
    embedded    EmbeddedBackend: an AsyncEngine in this process
    remote      RemoteBackend: a fairgate engine or any OpenAI-compatible server, over HTTP
    stream      a remote stream's events passed through, its tokens and usage noted
    discovery   DnsGroup: the replicas behind one DNS name
    pool        BackendPool: dispatch among the backends, prefix routing, outlier ejection

The names below are the package's public ones: `from gateway.backends import X`.
"""

from gateway.backends.base import (
    ENGINE_EXTENSIONS,
    KV_HIGH_WATER,
    RECENT_HORIZON_S,
    Backend,
    BackendErrored,
    BackendFailed,
    BackendUnavailable,
    BackendUnreachable,
    Job,
    Outcome,
    RecentWork,
    engine_body,
    room_from_load,
)
from gateway.backends.discovery import DnsGroup, Resolver, resolve
from gateway.backends.embedded import EmbeddedBackend
from gateway.backends.pool import (
    HOMES_PER_PREFIX,
    PREFIX_HOMES,
    PREFIX_LOAD_SLACK,
    BackendPool,
    PrefixHomes,
)
from gateway.backends.remote import HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, RemoteBackend
from gateway.backends.stream import pass_event

__all__ = [
    "ENGINE_EXTENSIONS",
    "HEALTH_INTERVAL_S",
    "HEALTH_TIMEOUT_S",
    "HOMES_PER_PREFIX",
    "KV_HIGH_WATER",
    "PREFIX_HOMES",
    "PREFIX_LOAD_SLACK",
    "RECENT_HORIZON_S",
    "Backend",
    "BackendErrored",
    "BackendFailed",
    "BackendPool",
    "BackendUnavailable",
    "BackendUnreachable",
    "DnsGroup",
    "EmbeddedBackend",
    "Job",
    "Outcome",
    "PrefixHomes",
    "RecentWork",
    "RemoteBackend",
    "Resolver",
    "engine_body",
    "pass_event",
    "resolve",
    "room_from_load",
]
