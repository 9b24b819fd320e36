"""What does keeping freed step memory (engine/host_memory.py) do for the CPU engine? The same
steps with glibc's malloc as the engine sets it and as glibc's defaults leave it, each in its
own process (malloc's settings are per process), alternating.

Each process builds the real engine (`random:tiny`, TorchExecutor, one torch thread) and runs
requests of several prompt lengths one at a time, timing each prefill step and the decode
steps after it, with the minor page faults of each. The defaults are had by setting
`GLIBC_TUNABLES` to a no-op tunable, which the engine takes as the operator's choice.

    .venv/bin/python bench/cpu_malloc.py [--rounds 2] [--requests 25]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository

from bench.common import machine  # noqa: E402
from engine import host_memory  # noqa: E402

PROMPTS = (128, 300, 480)
DEFAULTS_ENV = {"GLIBC_TUNABLES": "glibc.malloc.check=0"}  # no-op: malloc stays glibc's own


def measure(requests: int) -> dict[str, object]:
    """In this process: per prompt length, median prefill and decode step times and faults."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model="random:tiny", max_num_seqs=32,
                                    max_num_batched_tokens=512))
    vocab = engine.executor.vocab_size

    def one(prompt: int, i: int) -> tuple[float, int, list[float]]:
        # a different first token each time: no prefix-cache hit makes the prefill shorter
        engine.add_request(f"p{prompt}-{i}", [(7 * j + 13 * i + prompt) % vocab
                                              for j in range(prompt)],
                           SamplingParams(max_tokens=16, ignore_eos=True))
        steps: list[tuple[float, int]] = []
        while engine.has_unfinished():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - start,
                          resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        return steps[0][0], steps[0][1], [s for s, _ in steps[1:]]

    for i in range(4):
        one(64, i)
    out: dict[str, object] = {"malloc": host_memory.state()}
    for prompt in PROMPTS:
        runs = [one(prompt, i) for i in range(requests)]
        out[str(prompt)] = {
            "prefill_ms": 1e3 * statistics.median(r[0] for r in runs),
            "faults": statistics.median(r[1] for r in runs),
            "decode_ms": 1e3 * statistics.median(d for r in runs for d in r[2])}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=25, help="per prompt length")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.requests)))
        return 0
    print(f"random:tiny on the CPU, one torch thread, {args.requests} requests per prompt "
          f"length and configuration, {args.rounds} rounds alternating; {machine()}")
    labels = ("kept (the engine's setting)", "glibc's defaults")
    results: dict[str, list[dict[str, object]]] = {label: [] for label in labels}
    for round_ in range(args.rounds):
        for label in labels[round_ % 2:] + labels[:round_ % 2]:
            env = dict(os.environ)
            for name in host_memory.OPERATOR_ENV:
                env.pop(name, None)
            if label != labels[0]:
                env.update(DEFAULTS_ENV)
            done = subprocess.run([sys.executable, __file__, "--child", "--requests",
                                   str(args.requests)], env=env, cwd=ROOT, check=True,
                                  capture_output=True, text=True)
            results[label].append(json.loads(done.stdout.splitlines()[-1]))
    for label in labels:
        print(f"{label}: malloc {results[label][0]['malloc']}")
    print(f"{'prompt':>6}  {'prefill ms, kept / defaults':>28}  {'ratio':>5}  "
          f"{'faults':>13}  {'decode ms':>13}")
    for prompt in map(str, PROMPTS):
        def mid(label: str, key: str, p: str = prompt) -> float:
            return statistics.median(float(r[p][key]) for r in results[label])  # type: ignore[index]
        kept, default = mid(labels[0], "prefill_ms"), mid(labels[1], "prefill_ms")
        print(f"{prompt:>6}  {kept:>12.2f} / {default:<13.2f}  {kept / default:>5.2f}  "
              f"{mid(labels[0], 'faults'):>5.0f} / {mid(labels[1], 'faults'):<5.0f}  "
              f"{mid(labels[0], 'decode_ms'):>5.2f} / {mid(labels[1], 'decode_ms'):<5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
