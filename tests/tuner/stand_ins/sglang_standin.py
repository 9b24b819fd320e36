"""`python -m sglang.launch_server --model-path MODEL` with exactly the flags fairgate tune
gives SGLang (see standin.py)."""

from __future__ import annotations

import argparse

import standin  # this folder is the script's sys.path[0]

OOM = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
KNOB_FLAGS: standin.KnobFlags = {
    "--max-running-requests": ("max_num_seqs", int),
    "--chunked-prefill-size": ("max_num_batched_tokens", int),
    "--context-length": ("max_model_len", int),
    "--mem-fraction-static": ("memory_fraction", float),
}

parser = argparse.ArgumentParser(prog="sglang.launch_server")
parser.add_argument("--model-path", required=True)
standin.add_flags(parser, "127.0.0.1", 30000, KNOB_FLAGS)
args = parser.parse_args()
standin.run(args.model_path, args, KNOB_FLAGS, OOM)
