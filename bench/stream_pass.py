"""What the gateway's SSE pass-through costs per streamed answer, against reading it event by event.

Each stream is what an engine sends for one answer (16 token events, the last with its finish
reason, the usage event and [DONE]), passed through `gateway.backends.stream.pass_chunk` as the
gateway does (a stream's `SSEReader` and `PlainTokens`; the client did not ask for usage), and
through the baseline: every event through `SSEReader.feed` and `pass_event`, one by one. Both run
in this process, interleaved, and their outputs are checked to be the same. Four shapes:

- one read: the whole answer in one read (a backend that writes faster than the gateway reads;
  `bench/gateway_cpu.py`'s mock);
- one event per read: an engine generating token by token;
- and both again with a field that differs in every token event (OpenAI's `obfuscation`), where
  no template holds and each event is checked in full.

    .venv/bin/python bench/stream_pass.py [--streams 3000] [--repeats 7]

It prints µs per streamed answer for each way and their ratio; nothing here is a goal of its
own (issue 28's goal is the gateway's CPU per request, `bench/gateway_cpu.py`), but a ratio
above 1 on the first two shapes means the fast way lost its point.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from engine.request import SamplingParams  # noqa: E402
from gateway.backends import Job, Outcome  # noqa: E402
from gateway.backends.stream import pass_chunk, pass_event  # noqa: E402
from protocol.openai import parse_request  # noqa: E402
from protocol.sse import PlainTokens, SSEReader  # noqa: E402

TOKENS = 16


def events(varying: bool) -> list[bytes]:
    """One answer's events as an OpenAI-compatible engine writes them (json.dumps' spacing)."""
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1765000000,
            "model": "bench-model"}
    out = []
    for i in range(TOKENS):
        event: dict[str, object] = {**base, "choices": [{
            "index": 0, "delta": {"content": f" w{i}"},
            "finish_reason": "length" if i == TOKENS - 1 else None}]}
        if varying:
            event["obfuscation"] = "x" * (i % 7 + 1)
        out.append(event_bytes(event))
    usage = {"prompt_tokens": 20, "completion_tokens": TOKENS, "total_tokens": 20 + TOKENS}
    out.append(event_bytes({**base, "choices": [], "usage": usage}))
    return [*out, b"data: [DONE]\n\n"]


def event_bytes(body: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def at_once(reads: list[bytes], job: Job) -> bytes:
    reader, plain, outcome = SSEReader(), PlainTokens(), Outcome(prompt_tokens=20)
    return b"".join([pass_chunk(reader, plain, read, job, outcome) for read in reads])


def one_by_one(reads: list[bytes], job: Job) -> bytes:
    reader, outcome = SSEReader(), Outcome(prompt_tokens=20)
    return b"".join([pass_event(e.data, job, outcome) for read in reads
                     for e in reader.feed(read)])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--streams", type=int, default=3000, help="answers per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per way (the least)")
    args = parser.parse_args()
    if args.streams < 1 or args.repeats < 1:
        parser.error("--streams and --repeats must be at least 1")
    req = parse_request({"model": "bench-model", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]}, "chat")
    job = Job("bench", req, "bench", "interactive", 20, SamplingParams(max_tokens=TOKENS))
    print(f"{TOKENS} token events + usage + [DONE] per answer; µs per answer, the least of "
          f"{args.repeats} timings of {args.streams} answers, the two ways interleaved")
    for varying in (False, True):
        stream = events(varying)
        for label, reads in (("one read", [b"".join(stream)]), ("one event per read", stream)):
            assert at_once(reads, job) == one_by_one(reads, job)  # the same bytes to the client
            best = {at_once: float("inf"), one_by_one: float("inf")}
            for _ in range(args.repeats):
                for way in best:
                    took = timeit.timeit(lambda w=way, r=reads: w(r, job), number=args.streams)
                    best[way] = min(best[way], took / args.streams * 1e6)
            shape = f"{label}{', a field varies' if varying else ''}"
            print(f"{shape:<36} pass_chunk {best[at_once]:6.1f}   event by event "
                  f"{best[one_by_one]:6.1f}   ratio {best[at_once] / best[one_by_one]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
