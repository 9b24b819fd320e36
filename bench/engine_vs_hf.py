"""fairgate's LLMEngine vs transformers `generate` (static batches) on the same checkpoint.

A random Llama checkpoint (fp32, CPU) built with transformers; 64 requests whose prompt and
output lengths are sampled from the Azure LLM 2023 conversation trace, scaled down; greedy.
Prints output tokens/s of both (best of --repeats interleaved runs), their ratio against the
goal (issue 3: at least 2x), and where an engine step's time goes.

    .venv/bin/python bench/engine_vs_hf.py [--requests 64] [--scale 16] [--threads 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ holds a kernels.py: drop this folder from the path so `import kernels` is the package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

TRACE = _HERE.parent.parent / "shared/data/traces/azure_llm_2023_conv.csv"
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
MAX_PROMPT, MAX_OUTPUT = 256, 64  # caps on the scaled lengths, so a run takes a few minutes
GOAL_RATIO = 2.0  # issue 3: fairgate's output tokens/s at least twice transformers' best


def sample_workload(num: int, scale: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, lengths from the trace / scale."""
    with TRACE.open() as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    picked = rng.sample(rows, num)
    vocab = MODEL["vocab_size"]
    return [([rng.randrange(3, vocab) for _ in range(min(MAX_PROMPT, max(4, ctx // scale)))],
             min(MAX_OUTPUT, max(2, gen // scale))) for ctx, gen in picked]


def build_checkpoint(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(MODEL["vocab_size"])},
                               unk_token="w0")).save(str(folder / "tokenizer.json"))


def run_fairgate(folder: Path, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=str(folder), executor="torch",
                                    max_num_batched_tokens=1024, max_num_seqs=64,
                                    max_model_len=1024, num_kv_blocks=4096))
    executor: Any = engine.executor
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(f"r{i}", prompt_token_ids=prompt,
                           params=SamplingParams(max_tokens=out_len, ignore_eos=True))
    tokens, steps, step_total, executing = 0, 0, 0.0, 0.0
    started = time.perf_counter()
    while engine.has_unfinished():
        before = time.perf_counter()
        out = engine.step()
        step_total += time.perf_counter() - before
        executing += out.step_time
        tokens += len(out.sampled)
        steps += 1
    elapsed = time.perf_counter() - started
    timers = executor.timers
    return dict(tokens=tokens, seconds=elapsed, steps=steps, schedule=step_total - executing,
                swap=timers.swap, prepare=timers.prepare, forward=timers.forward,
                sample=timers.sample)


def run_hf(model: Any, work: list[tuple[list[int], int]], batch_size: int) -> dict[str, Any]:
    """Static batches in arrival order: left-padded prompts, each batch generates as many
    tokens as its longest request wants; only each request's own tokens count."""
    from transformers import GenerationConfig

    useful, started = 0, time.perf_counter()
    for first in range(0, len(work), batch_size):
        batch = work[first:first + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        config = GenerationConfig(max_new_tokens=max(n for _, n in batch), do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=config)
        useful += sum(n for _, n in batch)
    return dict(tokens=useful, seconds=time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--scale", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per side")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both sides (1 avoids OpenMP stalls on a "
                        "shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    work = sample_workload(args.requests, args.scale, args.seed)
    prompt_tokens, output_tokens = sum(len(p) for p, _ in work), sum(n for _, n in work)
    print(f"workload: {len(work)} requests from {TRACE.name} / {args.scale}: {prompt_tokens} "
          f"prompt tokens, {output_tokens} output tokens; model {MODEL} fp32 on CPU "
          f"({torch.get_num_threads()} threads)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(folder)
        run_fairgate(folder, work[:4])  # warm-up
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        run_hf(hf_model, work[:4], 4)  # warm-up
        ours: list[dict[str, Any]] = []
        theirs: dict[int, list[dict[str, Any]]] = {8: [], 16: [], 32: []}
        for _ in range(args.repeats):  # interleaved, so both sides see the same machine load
            ours.append(run_fairgate(folder, work))
            for b, runs in theirs.items():
                runs.append(run_hf(hf_model, work, b))
    report(fastest(ours), {b: fastest(runs) for b, runs in theirs.items()})


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["seconds"])


def report(ours: dict[str, Any], theirs: dict[int, dict[str, Any]]) -> None:
    ours_tps = ours["tokens"] / ours["seconds"]
    print(f"fairgate LLMEngine: {ours['tokens']} tokens in {ours['seconds']:.2f} s = "
          f"{ours_tps:.1f} output tok/s ({ours['steps']} steps)")
    for b, r in theirs.items():
        print(f"transformers generate, static batch {b:>2}: {r['tokens']} tokens in "
              f"{r['seconds']:.2f} s = {r['tokens'] / r['seconds']:.1f} output tok/s")
    best_b = max(theirs, key=lambda b: theirs[b]["tokens"] / theirs[b]["seconds"])
    best = theirs[best_b]["tokens"] / theirs[best_b]["seconds"]
    ratio = ours_tps / best
    print(f"ratio fairgate / best transformers (batch {best_b}): {ratio:.2f}x   "
          f"goal >= {GOAL_RATIO:g}x: {'met' if ratio >= GOAL_RATIO else 'NOT met'}")
    total = ours["seconds"]
    parts = ["schedule", "swap", "prepare", "forward", "sample"]
    shares = ", ".join(f"{p} {ours[p]:.2f} s ({100 * ours[p] / total:.0f}%)" for p in parts)
    print(f"engine step time: {shares}; per step {1000 * total / ours['steps']:.1f} ms")


if __name__ == "__main__":
    main()
