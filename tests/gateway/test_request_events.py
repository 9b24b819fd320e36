"""The serving path's request events (gateway/events.py), on the serving app alone
(gateway.app.make_app): an observer hears admitted, first_token and finished, with the timings
the gateway measured; one that raises costs the request nothing and is counted."""

from __future__ import annotations

from typing import Any

from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.events import FirstToken, RequestAdmitted, RequestFinished, RequestObserver
from gateway.state import GATEWAY
from tests.gateway.helpers import SIM_ENGINE, Harness, collect, completion, create_tenants
from tests.support.waiting import wait_for

TTFT_SLO_S = 7.5


class Recorder(RequestObserver):
    def __init__(self) -> None:
        self.events: list[RequestAdmitted | FirstToken | RequestFinished] = []

    def admitted(self, event: RequestAdmitted) -> None:
        self.events.append(event)

    def first_token(self, event: FirstToken) -> None:
        self.events.append(event)

    def finished(self, event: RequestFinished) -> None:
        self.events.append(event)


class Broken(RequestObserver):
    def admitted(self, event: RequestAdmitted) -> None:
        raise RuntimeError("admitted")

    def first_token(self, event: FirstToken) -> None:
        raise RuntimeError("first_token")

    def finished(self, event: RequestFinished) -> None:
        raise RuntimeError("finished")


async def _serving_gateway(aiohttp_client: Any, db_url: str) -> Harness:
    keys = await create_tenants(db_url, {"acme": {"slo_ttft_p99_s": TTFT_SLO_S}})
    app = make_app(GatewayConfig(demo_tenant=False, backend_poll_interval_s=0.02),
                   engine=SIM_ENGINE, database=db_url)
    return Harness(await aiohttp_client(app), app, keys)


async def test_an_observer_hears_a_streamed_request_with_its_timings(
        aiohttp_client: Any, db_url: str) -> None:
    h = await _serving_gateway(aiohttp_client, db_url)
    recorder = Recorder()
    h.app[GATEWAY].add_observer(recorder)
    resp = await h.post("acme", completion(max_tokens=4, stream=True, model="default"))
    chunks = [c async for c in collect(resp)]
    assert resp.status == 200 and chunks

    await wait_for(lambda: any(isinstance(e, RequestFinished) for e in recorder.events))
    admitted, first, finished = recorder.events
    assert isinstance(admitted, RequestAdmitted) and isinstance(first, FirstToken)
    assert isinstance(finished, RequestFinished)
    served_model = h.app[GATEWAY].pool.model_names()[0]
    assert admitted.tenant == first.tenant == finished.tenant == "acme"
    assert admitted.request_id == first.request_id == finished.request_id
    assert admitted.model == finished.model == served_model  # the alias resolved
    assert admitted.slo.ttft_s == finished.slo.ttft_s == TTFT_SLO_S
    assert admitted.priority == finished.priority and admitted.request.stream

    timing = finished.timing
    assert finished.status == 200 and timing.ok
    assert finished.backend == first.backend == h.app[GATEWAY].pool.backends[0].name
    assert finished.completion_tokens == timing.num_output_tokens == 4
    assert finished.prompt_tokens > 0
    assert admitted.arrival == first.arrival == finished.arrival == timing.start
    assert first.at == timing.token_times[0] and first.ttft == timing.ttft
    assert timing.start < first.at <= timing.token_times[-1] <= timing.end


async def test_a_raising_observer_does_not_fail_the_request(aiohttp_client: Any,
                                                            db_url: str) -> None:
    h = await _serving_gateway(aiohttp_client, db_url)
    recorder = Recorder()
    gateway = h.app[GATEWAY]
    gateway.add_observer(Broken())
    gateway.add_observer(recorder)  # after the broken one: still hears every event

    resp = await h.post("acme", completion(max_tokens=3, stream=True))
    chunks = [c async for c in collect(resp)]
    assert resp.status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = await h.post("acme", completion(max_tokens=3))
    assert whole.status == 200 and (await whole.json())["usage"]["completion_tokens"] == 3

    await wait_for(lambda: sum(isinstance(e, RequestFinished) for e in recorder.events) == 2)
    kinds = [type(e).__name__ for e in recorder.events]
    assert kinds.count("RequestAdmitted") == 2 and kinds.count("FirstToken") == 1
    assert all(e.status == 200 for e in recorder.events if isinstance(e, RequestFinished))
    assert gateway.observer_errors == 5  # 2 admitted, 1 first token, 2 finished
    assert "fairgate_gateway_observer_errors_total 5.0" in h.metrics()
