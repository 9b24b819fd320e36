"""Scale-out with real processes: a gateway over three `fairgate engine` replicas (the
simulated executor, in real time), two serving model A and one model B. Every request lands on
a replica serving its model; a replica killed mid-run fails no request before its first byte
(what it held unstarted is retried on the other), the streams it cut end with an SSE error
event, and the pool takes it back once it serves again.

Where requests ran is read from each engine's own /metrics: its finished requests and their
prompt tokens. The two models' prompts differ in length, so a replica's (requests, prompt
tokens) says how many of each model's requests it finished."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.tokenizer import ByteTokenizer
from tests.gateway.helpers import Harness, completion, start_gateway
from tests.support.processes import fairgate_engine_process, fairgate_engine_processes
from tests.support.waiting import wait_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL_A, MODEL_B = "random:tiny", "random:small"  # a sim engine's name (sim_model: its cost)
PROMPTS = {MODEL_A: "a question for model A", MODEL_B: "a longer question, this one for B"}
PROMPT_TOKENS = {model: len(ByteTokenizer().encode(p)) for model, p in PROMPTS.items()}
MAX_NUM_SEQS = 2
# Llama-3-8B's step times on an L4, in real time: a token every ~70 ms, so a LONG stream
# lasts ~2 s, time enough to kill its replica mid-way
ENGINE = ("executor=sim", "sim_clock=realtime", "sim_hardware=l4", "sim_model=llama-3-8b",
          "max_model_len=512", f"max_num_seqs={MAX_NUM_SEQS}")
SHORT, LONG = 4, 32  # max_tokens; a sim token is one character


@dataclass
class Replica:
    url: str
    model: str
    proc: subprocess.Popen[bytes]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass(frozen=True)
class Work:
    """Finished requests and their prompt tokens."""

    requests: int = 0
    prompt_tokens: int = 0

    def __sub__(self, other: Work) -> Work:
        return Work(self.requests - other.requests, self.prompt_tokens - other.prompt_tokens)

    def __add__(self, other: Work) -> Work:
        return Work(self.requests + other.requests, self.prompt_tokens + other.prompt_tokens)


def work(answers: Iterable[Answer]) -> Work:
    """What these answers' requests were, as an engine that finished them counts them."""
    models = [a.model for a in answers]
    return Work(len(models), sum(PROMPT_TOKENS[m] for m in models))


def all_of(model: str, done: Work) -> bool:
    """`done` is requests of `model` alone (another model's prompts have another length)."""
    return done.prompt_tokens == done.requests * PROMPT_TOKENS[model]


@dataclass
class Answer:
    """One streamed request as its client saw it."""

    model: str
    max_tokens: int
    status: int = 0
    body: str = ""  # of an answer that is not a 200
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # data: [DONE] came

    @property
    def text(self) -> str:
        return "".join(c.get("text", "") for e in self.events for c in e.get("choices", []))

    @property
    def errors(self) -> int:
        return sum("error" in e for e in self.events)

    @property
    def complete(self) -> bool:
        return (self.status == 200 and self.done and not self.errors
                and len(self.text) == self.max_tokens)

    @property
    def cut(self) -> bool:
        """Some tokens, then an error event that ends the stream."""
        return (self.status == 200 and 0 < len(self.text) < self.max_tokens
                and self.errors == 1 and "message" in self.events[-1].get("error", {}))

    def __repr__(self) -> str:
        return (f"Answer({self.model}, status={self.status}, body={self.body[:300]!r}, "
                f"text={len(self.text)}/{self.max_tokens}, last={self.events[-1:]}, "
                f"done={self.done})")


class Traffic:
    """Streamed completions through the gateway, each read to its end; every answer so far."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.answers: list[Answer] = []

    async def ask(self, model: str, max_tokens: int) -> Answer:
        answer = Answer(model, max_tokens)
        self.answers.append(answer)
        body = {**completion(PROMPTS[model], max_tokens=max_tokens, stream=True), "model": model}
        resp = await self.h.post("acme", body)
        answer.status = resp.status
        if resp.status != 200:
            answer.body = await resp.text()
            return answer
        async for raw in resp.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                answer.done = True
            elif line.startswith(b"data: "):
                answer.events.append(json.loads(line[6:]))
        return answer

    async def wave(self, *asks: tuple[str, int]) -> list[Answer]:
        """These requests all at once."""
        return list(await asyncio.gather(*(self.ask(model, n) for model, n in asks)))

    async def clients(self, *plans: list[str]) -> list[Answer]:
        """A client per plan, all at once, each sending its plan's requests one after another."""

        async def client(plan: list[str]) -> list[Answer]:
            return [await self.ask(model, SHORT) for model in plan]

        return [a for answers in await asyncio.gather(*map(client, plans)) for a in answers]


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        assert resp.status == 200, f"GET {url}: {resp.status}"
        return await resp.text()


async def finished(session: aiohttp.ClientSession, replica: Replica) -> Work:
    """The requests `replica` finished (its own count: it runs them to max_tokens), from its
    /metrics."""
    requests = prompt_tokens = 0.0
    for family in text_string_to_metric_families(await _get(session, f"{replica.url}/metrics")):
        for sample in family.samples:
            if sample.name == "fairgate_engine_requests_finished_total":
                assert sample.labels == {"model_name": replica.model,
                                         "finished_reason": "length"}, sample
                requests += sample.value
            elif sample.name == "fairgate_engine_prompt_tokens_total":
                prompt_tokens += sample.value
    return Work(int(requests), int(prompt_tokens))


async def ledger(session: aiohttp.ClientSession, replicas: list[Replica]) -> list[Work]:
    return [await finished(session, r) for r in replicas]


async def test_replicas_serve_their_model_and_a_killed_one_fails_no_request_unstarted(
        aiohttp_client: Any, db_url: str) -> None:
    with fairgate_engine_processes(*[(*ENGINE, f"model={m}")
                                     for m in (MODEL_A, MODEL_A, MODEL_B)]) as started:
        replicas = [Replica(url, model, proc)
                    for (url, proc), model in zip(started, (MODEL_A, MODEL_A, MODEL_B),
                                                  strict=True)]
        h = await start_gateway(aiohttp_client, db_url,
                                gateway={"backends": [{"url": r.url} for r in replicas]})
        await wait_for(lambda: all(b.healthy and b.model_name for b in h.gateway.pool.backends),
                       timeout=30)
        assert [h.gateway.pool.by_name(r.url).model_name for r in replicas] == [
            MODEL_A, MODEL_A, MODEL_B]
        async with aiohttp.ClientSession() as session:
            traffic = Traffic(h)
            await _all_land_on_their_model(traffic, session, replicas)
            victim = await _kill_one_mid_stream(traffic, session, replicas)
            await _back_in_the_pool(traffic, session, replicas, victim)


async def _all_land_on_their_model(traffic: Traffic, session: aiohttp.ClientSession,
                                   replicas: list[Replica]) -> None:
    """Phase 1: a steady mix from three clients; every request ran on a replica of its model."""
    before = await ledger(session, replicas)
    answers = await traffic.clients(*[[MODEL_A, MODEL_B, MODEL_A, MODEL_A]] * 3)
    assert all(a.complete for a in answers), [a for a in answers if not a.complete]
    done = [after - start for after, start in zip(await ledger(session, replicas), before,
                                                  strict=True)]
    assert all(all_of(r.model, d) for r, d in zip(replicas, done, strict=True)), done
    assert done[0] + done[1] == work(a for a in answers if a.model == MODEL_A), done
    assert done[2] == work(a for a in answers if a.model == MODEL_B), done


async def _kill_one_mid_stream(traffic: Traffic, session: aiohttp.ClientSession,
                               replicas: list[Replica]) -> Replica:
    """Phase 2: an A replica is SIGKILLed while it streams to some clients and holds others'
    requests unstarted. The streams it cut end with an error event; every other request
    completes, on the other A replica; none fails before its first byte. Returns the
    victim."""
    before = await ledger(session, replicas)
    first = len(traffic.answers)
    # 3 per A replica: MAX_NUM_SEQS streaming, one waiting in the engine
    wave = asyncio.create_task(traffic.wave(*[(MODEL_A, LONG)] * 6, *[(MODEL_B, LONG)] * 2))
    held: list[tuple[Replica, int]] = []

    async def all_a_seats_streaming_and_one_waiting() -> bool:
        a_answers = [a for a in traffic.answers[first:] if a.model == MODEL_A]
        assert not any(a.done or a.status not in (0, 200) for a in a_answers), a_answers
        if sum(bool(a.text) for a in a_answers) < 2 * MAX_NUM_SEQS:
            return False  # a replica streams MAX_NUM_SEQS at most: so both do
        for r in replicas[:2]:
            waiting = int(json.loads(await _get(session, f"{r.url}/load"))["waiting"])
            if waiting:
                held.append((r, waiting))
                return True
        return False

    await wait_until(all_a_seats_streaming_and_one_waiting, 30,
                     "every A seat streams and an A replica holds a request unstarted",
                     every=0.01)
    [(victim, waiting)] = held
    survivor = replicas[1 - replicas.index(victim)]
    victim.proc.kill()
    await asyncio.to_thread(victim.proc.wait, 10)
    # sent while the gateway may still take the victim for up: refused there, retried
    late = await traffic.wave((MODEL_A, SHORT), (MODEL_A, SHORT), (MODEL_B, SHORT))
    answers = [*await wave, *late]
    assert all(a.complete or a.cut for a in answers), [
        a for a in answers if not (a.complete or a.cut)]
    cut = [a for a in answers if a.cut]
    # exactly the victim's streams (it ran MAX_NUM_SEQS, each had sent tokens; none finished)
    assert len(cut) == MAX_NUM_SEQS and {a.model for a in cut} == {MODEL_A}, cut
    backend = traffic.h.gateway.pool.by_name(victim.url)
    await wait_for(lambda: not backend.healthy, timeout=10)
    failovers = traffic.h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_failovers_total", {"backend": victim.url})
    assert failovers is not None and failovers >= waiting, (failovers, waiting)
    i = replicas.index(survivor)
    done = await finished(session, survivor) - before[i]
    assert done == work(a for a in answers if a.model == MODEL_A and a.complete), done
    done = await finished(session, replicas[2]) - before[2]
    assert done == work(a for a in answers if a.model == MODEL_B), done
    return victim


async def _back_in_the_pool(traffic: Traffic, session: aiohttp.ClientSession,
                            replicas: list[Replica], victim: Replica) -> None:
    """Phase 3: the victim starts again on its port; the gateway finds it healthy and sends it
    A requests again."""
    backend = traffic.h.gateway.pool.by_name(victim.url)
    with fairgate_engine_process(*ENGINE, f"model={MODEL_A}", port=victim.port) as (url, proc):
        i = replicas.index(victim)
        replicas[i] = Replica(url, MODEL_A, proc)
        await wait_for(lambda: backend.healthy, timeout=30)
        before = await ledger(session, replicas)
        assert before[i] == Work()  # a new process
        answers = await traffic.wave(*[(MODEL_A, SHORT)] * 6, *[(MODEL_B, SHORT)] * 2)
        assert all(a.complete for a in answers), [a for a in answers if not a.complete]
        done = [after - start for after, start in zip(await ledger(session, replicas), before,
                                                      strict=True)]
        assert done[i].requests >= 1 and all_of(MODEL_A, done[i]), done
        assert done[0] + done[1] == work(a for a in answers if a.model == MODEL_A), done
        assert done[2] == work(a for a in answers if a.model == MODEL_B), done
