"""The pool of backends and how dispatch picks one: least outstanding work per seat, prefix
routing, headroom for tenants under their share, a canary's share limit.

Each remote backend tells the pool how every request ended, and the pool ejects a replica that
keeps failing (gateway/outlier.py): ejected, it takes no new requests until its ejection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.backends.base import Backend
from gateway.backends.discovery import DnsGroup
from gateway.backends.remote import RemoteBackend
from gateway.config import OutlierDetectionConfig
from gateway.outlier import OutlierDetector, Verdict

log = logging.getLogger("fairgate.gateway")


PREFIX_LOAD_SLACK = 2  # requests a prefix's home may hold over prefix routing's relative bound
PREFIX_HOMES = 65_536  # prefixes remembered (least recently used forgotten first)
HOMES_PER_PREFIX = 4  # replicas remembered per prefix (a hot one spills to more than one)


class PrefixHomes:
    """Where this gateway sent each prompt prefix lately: the replicas likely to hold its KV
    blocks. Keyed by chained hashes of the prompt's leading chunks, so the longest prefix seen
    before wins (a conversation's next turn finds its earlier turns' replica). Bounded (LRU)."""

    def __init__(self, capacity: int = PREFIX_HOMES) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[int, list[str]] = OrderedDict()

    def lookup(self, keys: tuple[int, ...]) -> list[str]:
        """The replicas of the longest prefix known, most recent first."""
        for key in reversed(keys):
            homes = self._homes.get(key)
            if homes is not None:
                self._homes.move_to_end(key)
                return homes
        return []

    def record(self, keys: tuple[int, ...], name: str) -> None:
        for key in keys:
            homes = self._homes.pop(key, [])
            self._homes[key] = [name, *(h for h in homes if h != name)][:HOMES_PER_PREFIX]
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._homes)


def _serves(b: Backend, model: str) -> bool:
    """`b` serves `model` (one that has not said its model yet serves any)."""
    return not b.model_name or b.model_name == model


def _load(b: Backend) -> tuple[float, float]:
    return b.outstanding_tokens() / max(1, b.seats()), b.inflight / max(1, b.capacity())


def _ring_point(key: int, name: str) -> int:
    """Where `name` sits on `key`'s ring (rendezvous hashing: the same order for a key on
    every gateway replica, and a backend that leaves moves only its own keys)."""
    digest = hashlib.blake2b(f"{key}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class BackendPool:
    """All backends; dispatch goes to the least loaded with room (outstanding tokens per seat)
    among those that take new requests (`admits`: not draining, not ejected, a canary within
    its share: `limit_share`).

    `headroom` (a fraction of each backend's seats) is kept free of tenants over their weighted
    share: `pick(keep_headroom=True)` finds room for them, `pick()` for tenants under it. A
    light tenant's request then starts in the engine's next step instead of waiting for a
    backlogged tenant's request to finish, and a lone tenant still fills every seat.

    `outliers` (gateway/outlier.py) hears how each remote backend's requests end and ejects a
    replica that keeps failing."""

    def __init__(self, backends: list[Backend], headroom: float = 0.0,
                 groups: list[DnsGroup] | None = None,
                 outlier_detection: OutlierDetectionConfig | None = None) -> None:
        if not backends and not groups:
            raise ValueError("at least one backend is needed")
        self.backends = backends
        self.headroom = headroom
        self.draining: set[str] = set()  # by name: no new dispatch (a reconfigure, a rollout)
        self.groups: list[DnsGroup] = list(groups or [])  # backends found by DNS, one per address
        self.homes = PrefixHomes()  # prefix routing: where each prefix went lately
        self.outliers = OutlierDetector(outlier_detection or OutlierDetectionConfig())
        # a canary's share limit: its share, and each of its model's replicas' `sent` then
        self.shares: dict[str, tuple[float, dict[str, int]]] = {}
        self.results: list[Callable[[Backend, Verdict], None]] = []  # told as `record` is
        for backend in backends:
            self._listen(backend)

    def add(self, backend: Backend) -> None:
        self._listen(backend)
        self.backends.append(backend)

    def remove(self, backend: Backend) -> None:
        self.backends.remove(backend)
        self.outliers.records.pop(backend.name, None)

    def _listen(self, backend: Backend) -> None:
        """A remote backend's request outcomes feed outlier detection."""
        if isinstance(backend, RemoteBackend) and backend.on_result is None:
            backend.on_result = self.record

    def record(self, backend: Backend, verdict: Verdict) -> None:
        """How one of `backend`'s requests ended (`results` are told too); a replica that
        keeps failing is ejected."""
        for hear in self.results:
            hear(backend, verdict)
        replicas = [b.name for b in self.backends if b.model_name == backend.model_name]
        if self.outliers.record(backend.name, verdict, replicas):
            state = self.outliers.state(backend.name)
            log.warning("backend %s ejected for %.0f s (ejection %d): its requests fail",
                        backend.name, state["ejected_until"] - time.time(), state["ejections"])

    def admits(self, b: Backend) -> bool:
        """Whether `b` takes new requests: not draining, not ejected, within its share."""
        return (b.name not in self.draining and not self.outliers.ejected(b.name)
                and self._within_share(b))

    def limit_share(self, name: str, share: float | None) -> None:
        """From now on, at most `share` of its model's requests go to `name` (a canary; the
        others take the rest, or they wait); None lifts the limit."""
        backend = self.by_name(name)
        if share is None or backend is None:
            self.shares.pop(name, None)
            return
        self.shares[name] = (share, {b.name: b.sent for b in self.serves(backend.model_name)})

    def _within_share(self, b: Backend) -> bool:
        """Handed one more, `b` would have less than its share of what its model's replicas
        were handed since its limit was set, plus one (so the first request may go)."""
        if b.name not in self.shares:
            return True
        share, start = self.shares[b.name]
        total = sum(r.sent - start.get(r.name, 0) for r in self.serves(b.model_name))
        return b.sent - start[b.name] < share * (total + 1)

    def available(self, b: Backend) -> bool:
        """Healthy and not ejected: it can serve now (draining: only its own streams)."""
        return b.healthy and not self.outliers.ejected(b.name)

    def replica_counts(self) -> dict[str, dict[str, int]]:
        """Per model served: its replicas, how many can serve now (`available`), how many are
        ejected."""
        counts: dict[str, dict[str, int]] = {}
        for model in self.model_names():
            replicas = [b for b in self.backends if b.model_name == model]
            counts[model] = {"replicas": len(replicas),
                             "available": sum(map(self.available, replicas)),
                             "ejected": sum(self.outliers.ejected(b.name) for b in replicas)}
        return counts

    def ejection_rows(self) -> list[tuple[str, bool, int]]:
        """(name, ejected now, times ejected) per backend: the ejection metrics."""
        rows = []
        for b in self.backends:
            record = self.outliers.records.get(b.name)
            rows.append((b.name, self.outliers.ejected(b.name),
                         record.ejections_total if record else 0))
        return rows

    def by_name(self, name: str) -> Backend | None:
        return next((b for b in self.backends if b.name == name), None)

    @property
    def primary(self) -> Backend:
        return self.backends[0]

    @property
    def healthy(self) -> bool:
        # Asked on every request: a loop costs 0.08 µs for a pool of one, any() over a
        # generator 0.46 (it makes one).
        for b in self.backends:  # noqa: SIM110
            if b.healthy:
                return True
        return False

    def serving_now(self, model: str) -> bool:
        """Whether a backend that serves `model` can serve now (`available`); a loop, as
        `healthy` is."""
        for b in self.backends:  # noqa: SIM110
            if _serves(b, model) and self.available(b):
                return True
        return False

    def several_models(self) -> bool:
        """Whether the backends serve more than one model (dispatch then goes by model)."""
        return len(self.backends) > 1 and len(self.model_names()) > 1

    def model_names(self) -> list[str]:
        if len(self.backends) == 1:  # the usual pool: asked on every request
            name = getattr(self.backends[0], "model_name", "")
            return [name] if name else []
        names = (getattr(b, "model_name", "") for b in self.backends)  # test doubles may lack it
        return list(dict.fromkeys(n for n in names if n))

    def resolve_model(self, name: str) -> str | None:
        """The model id `name` means: an id itself, else the one it is an alias of (another
        served name, or the model path, of a backend's model); None: nobody serves it."""
        if name in self.model_names():
            return name
        for b in self.backends:
            if getattr(b, "model_name", "") and name in getattr(b, "model_aliases", ()):
                return str(b.model_name)
        return None

    def _eligible(self, model: str | None, exclude: Backend | None = None) -> list[Backend]:
        """Backends that may take a request for `model` (`_may_take`)."""
        return [b for b in self.backends if self._may_take(b, model, exclude)]

    def _may_take(self, b: Backend, model: str | None, exclude: Backend | None) -> bool:
        """Not `exclude`, serving `model` (one that has not said its model yet serves any),
        admitting new requests."""
        return (b is not exclude and (model is None or _serves(b, model)) and self.admits(b))

    def _free(self, b: Backend, keep_headroom: bool) -> bool:
        return b.has_room() and not (keep_headroom and b.inflight >= b.seats() - self.reserved(b))

    def pick_affine(self, keys: tuple[int, ...], model: str | None, load_factor: float,
                    keep_headroom: bool = False) -> Backend | None:
        """Prefix routing (`keys`: the prompt's chained prefix hashes, shortest first). The
        replicas this gateway last sent its longest known prefix to (`homes`), while one has
        room and stays within the bound: `load_factor` x the average in-flight count after this
        request, plus PREFIX_LOAD_SLACK requests (a spilled request costs a whole prefill; a
        decoding one barely slows a replica). Otherwise, a prefix new here or one whose homes
        are full: the first on the key's rendezvous-hash order (the same on every gateway
        replica) among those within the bound and within `load_factor` of the least
        outstanding work per seat. None: no room."""
        candidates = self._eligible(model)
        free = [b for b in candidates if self._free(b, keep_headroom)]
        if not free:
            return None
        total = sum(b.inflight for b in candidates) + 1
        bound = math.ceil(load_factor * total / len(candidates)) + PREFIX_LOAD_SLACK
        for name in self.homes.lookup(keys):
            home = next((b for b in free if b.name == name), None)
            if home is not None and home.inflight + 1 <= bound:
                return home
        within = [b for b in free if b.inflight + 1 <= bound] or free
        least = min(_load(b)[0] for b in within)
        ring = sorted(within, key=lambda b: _ring_point(keys[0], b.name))
        return next((b for b in ring if _load(b)[0] <= load_factor * least), ring[0])

    def held_to(self, model: str | None) -> list[Backend]:
        """The backends whose tokenizer and context length a request for `model` is counted
        and held by: those that serve it when the pool serves several models, else all."""
        if model is None or len(self.backends) == 1 or not self.several_models():
            return self.backends
        return self.serves(model) or self.backends

    def serves(self, model: str) -> list[Backend]:
        """The backends that serve `model` (one that has not said its model yet serves any)."""
        return [b for b in self.backends if _serves(b, model)]

    def capacity(self) -> int:
        """Room of the backends that take work (seats and slack): what shares are shares of."""
        return sum(b.capacity() for b in self.backends if self.available(b))

    def reserved(self, backend: Backend) -> int:
        """Seats of `backend` kept for tenants under their share (at least one stays shared)."""
        seats = backend.seats()
        return min(math.ceil(self.headroom * seats), seats - 1) if self.headroom > 0 else 0

    def pick(self, keep_headroom: bool = False, exclude: Backend | None = None,
             model: str | None = None) -> Backend | None:
        """The least loaded backend with room (`model`: among those serving it): the fewest
        outstanding tokens (queued and running work) per seat, then the fewest requests in
        flight for its room."""
        if len(self.backends) == 1:  # the usual pool of one: no list to build, nothing to compare
            b = self.backends[0]
            return b if self._may_take(b, model, exclude) and self._free(b, keep_headroom) else None
        free = [b for b in self._eligible(model, exclude) if self._free(b, keep_headroom)]
        return min(free, key=_load, default=None)

    def fallback(self, exclude: Backend, model: str | None) -> Backend | None:
        """For a request whose backend failed before answering: the least loaded other healthy
        backend serving its model, with room or not (the engine queues it; failing a request
        the client was promised is worse than one over the seats)."""
        return self.pick(exclude=exclude, model=model) or min(
            (b for b in self._eligible(model, exclude) if b.healthy), key=_load, default=None)

    async def start(self) -> None:
        for b in self.backends:
            await b.start()
        for group in self.groups:
            await group.refresh()
            group.task = asyncio.create_task(group.run(), name=f"discover {group.host}")

    async def close(self) -> None:
        for group in self.groups:
            if group.task is not None:
                group.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await group.task
        for b in list(self.backends):
            await b.close()
