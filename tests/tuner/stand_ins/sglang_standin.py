"""`python -m sglang.launch_server --model-path MODEL` with exactly the flags fairgate tune
gives SGLang (see standin.py)."""

from __future__ import annotations

import argparse

import standin  # this folder is the script's sys.path[0]

OOM = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."

parser = argparse.ArgumentParser(prog="sglang.launch_server")
parser.add_argument("--model-path", required=True)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=30000)
parser.add_argument("--max-running-requests", type=int)
parser.add_argument("--chunked-prefill-size", type=int)
parser.add_argument("--context-length", type=int)
parser.add_argument("--mem-fraction-static", type=float)
args = parser.parse_args()
standin.run(args.model_path, args.host, args.port,
            {"max_num_seqs": args.max_running_requests,
             "max_num_batched_tokens": args.chunked_prefill_size,
             "max_model_len": args.context_length,
             "memory_fraction": args.mem_fraction_static}, OOM)
