"""The dispatcher: hands queued requests to backends while a backend has room.

It runs inline (on every push and every finish) rather than as a task woken by events, so an
idle gateway dispatches a request in the same event-loop turn it was admitted: no added hop.
A ticker re-runs it for room that appears without a finish here (remote /load updates, KV
freed by other clients of a shared engine).
"""

from __future__ import annotations

import asyncio

from gateway.backends import Backend, BackendPool
from gateway.fairqueue import FairQueue, QueueBounds, QueuedRequest
from gateway.metrics import GatewayMetrics


class Dispatcher:
    def __init__(self, queue: FairQueue, pool: BackendPool, metrics: GatewayMetrics) -> None:
        self.queue = queue
        self.pool = pool
        self.metrics = metrics

    def submit(self, item: QueuedRequest, bounds: QueueBounds) -> asyncio.Future[Backend]:
        """Queue `item` (QueueFull when its tenant's queue is full); the future resolves to the
        backend it was dispatched to."""
        future: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        item.payload = future
        self.queue.push(item, bounds)
        self.pump()
        self._gauge(item)
        return future

    def pump(self) -> None:
        while self.queue.size:
            backend = self.pool.pick()
            if backend is None:
                return
            item = self.queue.pop()
            if item is None:  # everyone queued is at their max_concurrent
                return
            self._gauge(item)
            future: asyncio.Future[Backend] = item.payload
            if future.done():  # its waiter is gone; nothing ran
                self.queue.finish(item, 0, 0)
                continue
            backend.inflight += 1
            future.set_result(backend)

    def abandon(self, item: QueuedRequest) -> bool:
        """The waiter gave up (timeout, disconnect). True when it was still queued."""
        removed = self.queue.remove(item)
        if removed:
            self._gauge(item)
        return removed

    def release(self, item: QueuedRequest, backend: Backend, input_tokens: int,
                output_tokens: int) -> None:
        backend.inflight -= 1
        self.queue.finish(item, input_tokens, output_tokens)
        self.pump()

    def _gauge(self, item: QueuedRequest) -> None:
        depth = self.queue.depth_by_class(item.tenant)[item.priority]
        self.metrics.queue_depth.labels(item.tenant, item.priority).set(depth)


async def tick(dispatcher: Dispatcher, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        if dispatcher.queue.size:
            dispatcher.pump()
