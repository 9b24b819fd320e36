from __future__ import annotations

from pathlib import Path

import pytest

from tuner.traces import TraceError, TraceRequest, load_trace, write_fairgate_trace
from tuner.workload import traces_dir

TRACES = traces_dir()
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"no public traces at {TRACES}")


@needs_traces
def test_azure_trace_loads_sorted_from_zero() -> None:
    reqs = load_trace(TRACES / "azure_llm_2023_code.csv")
    assert len(reqs) == 8819  # as the README says
    assert reqs[0].arrival == 0.0
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:], strict=False))
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == (4808, 10)
    assert reqs[1].arrival == pytest.approx(0.052, abs=1e-6)


@needs_traces
def test_mooncake_trace_keeps_prefix_blocks() -> None:
    reqs = load_trace(TRACES / "mooncake_conversation.jsonl")
    assert len(reqs) >= 12_000
    first = reqs[0]
    assert first.prompt_tokens == 6758 and first.output_tokens == 500
    assert first.prefix_hashes[:3] == (0, 1, 2) and first.block_tokens == 512
    shared = sum(1 for r in reqs if r.prefix_hashes[:1] == (0,))
    assert shared > 1  # hash 0 is a prefix many requests share


def test_fairgate_trace_round_trips(tmp_path: Path) -> None:
    reqs = [
        TraceRequest(0.0, 100, 10, tenant="acme", priority="interactive", max_tokens=64),
        TraceRequest(0.5, 1200, 3, prefix_hashes=(7, 8, 9), block_tokens=512),
    ]
    path = tmp_path / "t.jsonl"
    write_fairgate_trace(path, reqs)
    assert load_trace(path) == reqs


GOOD = '{"arrival": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    ("name", "text", "fmt", "message"),
    [
        ("bad.jsonl", GOOD + '\n{"arrival": 1, oops}\n', "auto", r"bad\.jsonl:3: not valid JSON"),
        ("t.jsonl", GOOD + '{"arrival": 1}\n', "fairgate", r"t\.jsonl:2: .*'prompt_tokens'"),
        ("t.jsonl", GOOD + "[1, 2]\n", "fairgate", r"t\.jsonl:2: expected a JSON object"),
        (
            "m.jsonl",
            '{"timestamp": 0, "input_length": 0, "output_length": 2}\n',
            "auto",
            r"m\.jsonl:1: .*prompt length must be >= 1",
        ),
        (
            "a.csv",
            HEADER + "2023-11-16 18:17:03.97,10,2\nyesterday,1,1\n",
            "auto",
            r"a\.csv:3: bad row",
        ),
        ("a.csv", "when,in,out\n", "auto", r"a\.csv:1: expected header"),
    ],
)
def test_bad_lines_name_file_and_line(
    tmp_path: Path, name: str, text: str, fmt: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path, fmt)


def test_unreadable_and_unknown(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"something": 1}\n')
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        load_trace(odd)
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(odd, "parquet")


def test_zero_output_becomes_one_token(tmp_path: Path) -> None:
    path = tmp_path / "z.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 3, "output_length": 0}\n')
    assert load_trace(path)[0].output_tokens == 1
