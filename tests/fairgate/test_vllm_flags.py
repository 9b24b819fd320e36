"""`fairgate engine` takes vLLM's flags (engine/vllm_flags.py): every flag of the table, and
every flag of an independent list written here from vLLM's `serve --help`, reaches its knob with
vLLM's meaning; vLLM's flags fairgate lacks are one line naming them, exit 2; the docs hold
the table as the module writes it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.vllm_flags import (
    KNOB_FLAGS,
    NOT_FAIRGATES,
    VLLM_FLAGS,
    Target,
    flag_for,
    markdown_table,
)
from fairgate.cli import build_parser, main
from fairgate.engine_cli import build_config, flag_knobs
from tests.support.processes import ROOT, spawn_fairgate

KEY = "a-key-of-sixteen-or-more"
# vLLM's flag -> (its arguments, the knob, the value fairgate's config gets): written from vLLM's
# EngineArgs and frontend flags, not from the table, so the table cannot silently lose one
EXPECTED_KNOBS: dict[str, tuple[list[str], str, Any]] = {
    "--model": (["random:small"], "model", "random:small"),
    "--served-model-name": (["my-model", "alt"], "served_model_name", ("my-model", "alt")),
    "--max-num-seqs": (["32"], "max_num_seqs", 32),
    "--max-num-batched-tokens": (["4k"], "max_num_batched_tokens", 4000),
    "--max-model-len": (["1K"], "max_model_len", 1024),
    "--gpu-memory-utilization": (["0.5"], "memory_fraction", 0.5),
    "--kv-cache-dtype": (["int8"], "kv_cache_dtype", "int8"),
    "--block-size": (["32"], "block_size", 32),
    "--swap-space": (["2"], "swap_space_gb", 2.0),  # GiB, as vLLM's
    "--num-gpu-blocks-override": (["300"], "num_kv_blocks", 300),
    "--enable-prefix-caching": ([], "enable_prefix_caching", True),
    "--long-prefill-token-threshold": (["128"], "long_prefill_token_threshold", 128),
    "--max-num-partial-prefills": (["2"], "max_num_partial_prefills", 2),
    "--dtype": (["half"], "dtype", "float16"),  # vLLM's name for float16
    "--seed": (["7"], "seed", 7),
}
EXPECTED_SERVER: dict[str, tuple[list[str], str, Any]] = {
    "--host": (["0.0.0.0"], "host", "0.0.0.0"),
    "--port": (["9000"], "port", 9000),
    "--api-key": ([KEY], "api_key", KEY),
}
EXPECTED = {**EXPECTED_KNOBS, **EXPECTED_SERVER}


def parse(*argv: str) -> argparse.Namespace:
    args = ["engine", *argv]
    return build_parser(args).parse_args(args)


def configured(tmp_path: Path, *argv: str) -> EngineConfig:
    """The config `fairgate engine -c FILE ARGV` runs, FILE setting every knob the flags set to
    something else (so a flag that does not reach its knob shows)."""
    path = tmp_path / "fairgate.yaml"
    path.write_text("engine:\n  enable_prefix_caching: false\n  max_num_seqs: 16\n")
    args = parse("-c", str(path), *argv)
    return build_config(args.config, args.overrides, flag_knobs(args))


def check_flag_reaches_its_knob(tmp_path: Path, flag: str) -> None:
    values, name, expected = EXPECTED[flag]
    if flag in EXPECTED_SERVER:
        assert getattr(parse(flag, *values), name) == expected
        return
    config = configured(tmp_path, flag, *values)
    assert getattr(config, name) == expected
    file_value = {"enable_prefix_caching": False, "max_num_seqs": 16}
    assert expected != file_value.get(name, getattr(EngineConfig(), name))  # a real change


@pytest.mark.parametrize("flag", [f.flag for f in VLLM_FLAGS])
def test_every_flag_of_the_table_reaches_its_knob(tmp_path: Path, flag: str) -> None:
    assert flag in EXPECTED, f"{flag} is in the table but not in EXPECTED: add what it sets"
    check_flag_reaches_its_knob(tmp_path, flag)


@pytest.mark.parametrize("flag", EXPECTED)
def test_every_expected_flag_is_in_the_table(tmp_path: Path, flag: str) -> None:
    [row] = [f for f in VLLM_FLAGS if f.flag == flag]
    assert row.name == EXPECTED[flag][1]
    assert (row.target is Target.SERVER) == (flag in EXPECTED_SERVER)
    check_flag_reaches_its_knob(tmp_path, flag)


def test_no_enable_prefix_caching_turns_it_off(tmp_path: Path) -> None:
    assert EngineConfig().enable_prefix_caching is True
    assert build_config(None, [], flag_knobs(parse("--no-enable-prefix-caching"))
                        ).enable_prefix_caching is False


def test_flags_over_the_file_and_unset_flags_leave_it(tmp_path: Path) -> None:
    config = configured(tmp_path, "--max-num-seqs", "48")
    assert config.max_num_seqs == 48 and config.enable_prefix_caching is False  # the file's
    assert configured(tmp_path).max_num_seqs == 16


def test_model_positional_as_vllm_serve_takes_it() -> None:
    args = parse("random:small", "--max-num-seqs", "8")
    config = build_config(None, [], flag_knobs(args))
    assert (config.model, config.max_num_seqs) == ("random:small", 8)
    assert build_config(None, [], flag_knobs(parse())).model == "random:tiny"


def test_the_tuners_vllm_flags_are_the_tables() -> None:
    from tuner.engines import VLLM

    for knob, flag in VLLM.knob_flags.items():
        assert flag_for(knob) == flag


@pytest.mark.parametrize(("argv", "message"), [
    (["random:tiny", "--model", "random:small"], "MODEL (random:tiny) and --model both name"),
    (["--max-num-seqs", "8", "--set", "max_num_seqs=9"],
     "--max-num-seqs and --set max_num_seqs=... both set max_num_seqs: give one"),
    (["--gpu-memory-utilization", "0.5", "--set", "gpu_memory_utilization=0.6"],
     "both set memory_fraction"),
    (["--max-num-seqs", "lots"], "--max-num-seqs expects an integer, got 'lots'"),
    (["--max-model-len", "8q"], "--max-model-len expects an integer such as 8192"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: memory_fraction must be "
                                          "in (0, 1], got 1.5"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: kv_cache_dtype must be one of"),
    (["--block-size", "24"], "--block-size: block_size must be a power of two"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                           argv: list[str], message: str) -> None:
    assert main(["engine", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairgate engine: error:") and message in err, err
    assert err.count("\n") == 1


# vLLM serve flags a runbook carries (each with a value where it takes one), written here, not
# taken from NOT_FAIRGATES
VLLM_ONLY = [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--pipeline-parallel-size=2"],
             ["--enforce-eager"], ["--trust-remote-code"], ["--quantization", "awq"],
             ["--max-logprobs", "5"], ["--disable-log-requests"], ["--enable-chunked-prefill"],
             ["--speculative-config", "{}"], ["--lora-modules", "a=b"], ["--tokenizer", "t"],
             ["--revision", "main"], ["--download-dir", "/tmp"], ["--load-format", "auto"],
             ["--distributed-executor-backend", "ray"], ["--data-parallel-size", "2"]]


@pytest.mark.parametrize("argv", VLLM_ONLY, ids=lambda a: a[0])
def test_a_vllm_flag_fairgate_lacks_is_named_in_one_line(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["engine", "random:tiny", *argv, "--max-num-seqs", "8"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    flag = argv[0].partition("=")[0]  # the flag typed, even one of a group with one reason
    assert any(flag in names for names in NOT_FAIRGATES)
    assert err.startswith(f"fairgate engine: error: {flag} is a vLLM flag fairgate does not "
                          "have"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--preemption-mode", "swap"], ["--num-scheduler-steps=8"],
                                  ["--kv-cache-memory-bytes", "1G", "--max-log-len", "9"]])
def test_a_flag_on_no_list_is_one_line_that_names_it(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """A flag neither fairgate nor NOT_FAIRGATES knows (vLLM has more than the list holds) is
    one line naming every such flag, exit 2, not argparse's usage plus 'unrecognized'."""
    assert main(["engine", "random:tiny", *argv, "--max-num-seqs", "8"]) == 2
    err = capsys.readouterr().err
    flags = ", ".join(a.partition("=")[0] for a in argv if a.startswith("--"))
    assert err.startswith(f"fairgate engine: error: {flags}: not a flag of fairgate engine "
                          "(if it is vLLM's, fairgate has no such knob); "
                          "`fairgate engine --help` lists its flags"), err
    assert err.count("\n") == 1


def test_an_unknown_flag_of_another_command_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tenants", "list", "--colour"]) == 2
    err = capsys.readouterr().err
    assert err == ("fairgate tenants: error: --colour: not a flag of fairgate tenants; "
                   "`fairgate tenants --help` lists its flags\n")


def test_every_refused_flag_is_refused_and_none_is_in_the_table() -> None:
    ours = {f.flag for f in VLLM_FLAGS} | {"--no-enable-prefix-caching"}
    for names in NOT_FAIRGATES:
        assert not ours & set(names), names
        for name in names:
            with pytest.raises(SystemExit) as exited:
                parse(name)
            assert exited.value.code == 2


def test_tensor_parallel_is_refused_by_the_real_command() -> None:
    proc = spawn_fairgate("engine", "random:tiny", "--tensor-parallel-size", "2")
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 2
    assert output.splitlines() == [
        "fairgate engine: error: --tensor-parallel-size is a vLLM flag fairgate does not have "
        "(fairgate runs one GPU per engine; run more engines behind the gateway)"]


def test_the_docs_hold_the_table_as_the_module_writes_it() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    table = markdown_table()
    holding = [p for p in pages if p.exists() and table in p.read_text()]
    assert holding, "no page holds engine.vllm_flags.markdown_table(): paste it in"
    for f in KNOB_FLAGS:
        assert f"`engine.{f.name}`" in table
