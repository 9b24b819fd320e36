"""`vllm serve MODEL` with exactly the flags fairgate tune gives vLLM (see standin.py)."""

from __future__ import annotations

import argparse

import standin  # this folder is the script's sys.path[0]

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
       "total capacity of 79.19 GiB of which 1.23 GiB is free.")
KNOB_FLAGS: standin.KnobFlags = {
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--max-model-len": ("max_model_len", int),
    "--gpu-memory-utilization": ("memory_fraction", float),
}

parser = argparse.ArgumentParser(prog="vllm")
commands = parser.add_subparsers(dest="command", required=True)
serve = commands.add_parser("serve")
serve.add_argument("model")
standin.add_flags(serve, "0.0.0.0", 8000, KNOB_FLAGS)
args = parser.parse_args()
standin.run(args.model, args, KNOB_FLAGS, OOM)
