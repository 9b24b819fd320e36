"""`vllm serve MODEL` with exactly the flags fairgate tune gives vLLM (see standin.py)."""

from __future__ import annotations

import argparse

import standin  # this folder is the script's sys.path[0]

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
       "total capacity of 79.19 GiB of which 1.23 GiB is free.")

parser = argparse.ArgumentParser(prog="vllm")
commands = parser.add_subparsers(dest="command", required=True)
serve = commands.add_parser("serve")
serve.add_argument("model")
serve.add_argument("--host", default="0.0.0.0")
serve.add_argument("--port", type=int, default=8000)
serve.add_argument("--max-num-seqs", type=int)
serve.add_argument("--max-num-batched-tokens", type=int)
serve.add_argument("--max-model-len", type=int)
serve.add_argument("--gpu-memory-utilization", type=float)
args = parser.parse_args()
standin.run(args.model, args.host, args.port,
            {"max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "max_model_len": args.max_model_len,
             "memory_fraction": args.gpu_memory_utilization}, OOM)
