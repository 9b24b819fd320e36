"""protocol.validators: each check on good and bad values, and the same bad values through every
config surface that uses them (engine, gateway, gateway backends, sampling, tenants, tuner)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine import EngineConfig, SamplingParams
from gateway.config import GatewayConfig
from protocol.validators import (
    check_bool,
    check_choice,
    check_int,
    check_known_keys,
    check_number,
    check_positive_int,
    from_mapping,
)
from tenants import TenantInfo, TenantLimits
from tuner.loadgen import RunOptions
from tuner.workload import LoadShape

Check = Callable[[object], object]

GOOD: list[tuple[Check, object]] = [
    (lambda v: check_choice("policy", v, ("fcfs", "fair")), "fair"),
    (lambda v: check_int("seed", v), -3),
    (lambda v: check_int("top_k", v, low=0), 0),
    (lambda v: check_int("logprobs", v, low=0, high=20), 20),
    (lambda v: check_int("x", v, high=5), -(2**70)),
    (lambda v: check_positive_int("max_num_seqs", v), 1),
    (lambda v: check_number("swap_space_gb", v, low=0), 0),
    (lambda v: check_number("top_p", v, 0.0, 1.0, open_low=True), 1.0),
    (lambda v: check_number("headroom", v, 0, 1, open_high=True), 0.0),
    (lambda v: check_number("t", v), -1e300),
    (lambda v: check_bool("log_requests", v), False),
]


@pytest.mark.parametrize(("check", "value"), GOOD)
def test_good_values_are_returned_unchanged(check: Check, value: object) -> None:
    assert check(value) == value


BAD: list[tuple[Check, object, str]] = [
    (lambda v: check_choice("policy", v, ("fcfs", "fair")), "lifo",
     "policy must be one of fcfs | fair, got 'lifo'"),
    (lambda v: check_choice("policy", v, ("fcfs", "fair")), "fiar",
     "policy must be one of fcfs | fair, got 'fiar'; did you mean fair?"),
    (lambda v: check_choice("policy", v, ("fcfs", "fair")), None,
     "policy must be one of fcfs | fair, got None"),
    (lambda v: check_choice("policy", v, ("fcfs", "fair")), 1, "got 1"),
    (lambda v: check_int("seed", v), True, "seed must be an integer, got True"),
    (lambda v: check_int("seed", v), 1.0, "seed must be an integer, got 1.0"),
    (lambda v: check_int("seed", v), "3", "seed must be an integer, got '3'"),
    (lambda v: check_int("seed", v), math.nan, "seed must be an integer, got nan"),
    (lambda v: check_int("top_k", v, low=0), -1, "top_k must be >= 0, got -1"),
    (lambda v: check_int("top_k", v, low=0), False, "top_k must be an integer >= 0, got False"),
    (lambda v: check_int("logprobs", v, low=0, high=20), 21, "logprobs must be in [0, 20], got 21"),
    (lambda v: check_int("x", v, high=5), 6, "x must be <= 5, got 6"),
    (lambda v: check_int("gateway.port", v, 0, 65535), "80",
     "gateway.port must be an integer in [0, 65535], got '80'"),
    (lambda v: check_positive_int("max_num_seqs", v), 0,
     "max_num_seqs must be a positive integer, got 0"),
    (lambda v: check_positive_int("max_num_seqs", v), True,
     "max_num_seqs must be a positive integer, got True"),
    (lambda v: check_positive_int("max_num_seqs", v), 2.0,
     "max_num_seqs must be a positive integer, got 2.0"),
    (lambda v: check_positive_int("max_num_seqs", v), math.inf,
     "max_num_seqs must be a positive integer, got inf"),
    (lambda v: check_number("swap_space_gb", v, low=0), -0.5, "swap_space_gb must be >= 0, got -0.5"),
    (lambda v: check_number("swap_space_gb", v, low=0), math.nan,
     "swap_space_gb must be a finite number >= 0, got nan"),
    (lambda v: check_number("swap_space_gb", v, low=0), math.inf,
     "swap_space_gb must be a finite number >= 0, got inf"),
    (lambda v: check_number("swap_space_gb", v, low=0), 10**400,  # too large for a float
     "swap_space_gb must be a finite number >= 0, got 1000"),
    (lambda v: check_number("swap_space_gb", v, low=0), True,
     "swap_space_gb must be a finite number >= 0, got True"),
    (lambda v: check_number("swap_space_gb", v, low=0), "1",
     "swap_space_gb must be a finite number >= 0, got '1'"),
    (lambda v: check_number("timeout_s", v, low=0, open_low=True), 0, "timeout_s must be > 0, got 0"),
    (lambda v: check_number("top_p", v, 0.0, 1.0, open_low=True), 0.0,
     "top_p must be in (0.0, 1.0], got 0.0"),
    (lambda v: check_number("top_p", v, 0.0, 1.0, open_low=True), -math.inf,
     "top_p must be a number in (0.0, 1.0], got -inf"),
    (lambda v: check_number("headroom", v, 0, 1, open_high=True), 1, "headroom must be in [0, 1), got 1"),
    (lambda v: check_number("x", v, high=2.0, open_high=True), 2.0, "x must be < 2.0, got 2.0"),
    (lambda v: check_number("x", v, high=2.0), 2.5, "x must be <= 2.0, got 2.5"),
    (lambda v: check_number("t", v), math.nan, "t must be a finite number, got nan"),
    (lambda v: check_bool("log_requests", v), "false", "log_requests must be true or false, got 'false'"),
    (lambda v: check_bool("log_requests", v), 1, "log_requests must be true or false, got 1"),
]


@pytest.mark.parametrize(("check", "value", "message"), BAD)
def test_bad_values_say_what_is_wanted(check: Check, value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check(value)
    assert message in str(info.value)


KNOBS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


@pytest.mark.parametrize(("values", "message"), [
    ({"max_num_seq": 1}, "unknown engine setting(s): max_num_seq; did you mean max_num_seqs?"),
    ({"colour": 1}, "unknown engine setting(s): colour; "
                    "known settings are: max_num_seqs, max_num_batched_tokens, block_size"),
    ({"block_sise": 1, "max_num_seq": 1}, "unknown engine setting(s): block_sise, max_num_seq; "
                                          "did you mean block_size for block_sise, "
                                          "max_num_seqs for max_num_seq?"),
    ({"block_sise": 1, "colour": 1}, "did you mean block_size for block_sise?; known settings are"),
    ({1: 1}, "unknown engine setting(s): 1; known settings are"),
])
def test_unknown_keys_suggest_the_closest_known_key(values: dict[object, object],
                                                    message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_known_keys("engine", values, KNOBS)
    assert message in str(info.value)
    check_known_keys("engine", {"max_num_seqs": 1, "block_size": 2}, KNOBS)  # known: no error


@dataclass(frozen=True)
class Point:
    x: int
    y: int = 0

    def __post_init__(self) -> None:
        check_int("point.x", self.x)


def test_from_mapping_builds_a_dataclass_and_names_bad_keys() -> None:
    assert from_mapping(Point, {"x": 1}, "point") == Point(1)
    with pytest.raises(ValueError, match=re.escape("unknown point setting(s): z; known settings are: x, y")):
        from_mapping(Point, {"x": 1, "z": 2}, "point")
    with pytest.raises(ValueError, match=re.escape("missing point setting(s): x")):
        from_mapping(Point, {"y": 1}, "point")
    with pytest.raises(ValueError, match="point.x must be an integer"):
        from_mapping(Point, {"x": "1"}, "point")
    with pytest.raises(ValueError, match="the point settings must be a mapping"):
        from_mapping(Point, [1, 2], "point")  # type: ignore[arg-type]
    assert EngineConfig.from_dict(None) == EngineConfig()


def _backend(key: str, value: object) -> object:
    return GatewayConfig.from_dict({"backends": [{"url": "http://h:1", key: value}]})


Build = Callable[[object], object]

# a count on every surface: (how the surface is built from the value, the key as it is spelt)
COUNTS: list[tuple[Build, str]] = [
    (lambda v: EngineConfig.from_dict({"max_num_seqs": v}), "max_num_seqs"),
    (lambda v: GatewayConfig.from_dict({"max_queued_requests": v}), "gateway.max_queued_requests"),
    (lambda v: _backend("max_inflight", v), "gateway.backends[].max_inflight"),
    (lambda v: SamplingParams(max_tokens=v), "max_tokens"),  # type: ignore[arg-type]
    (lambda v: TenantLimits(max_concurrent=v), "max_concurrent"),  # type: ignore[arg-type]
    (lambda v: RunOptions(max_concurrency=v), "max_concurrency"),  # type: ignore[arg-type]
]
# a positive number (a timeout, a weight, a size) on every surface that has one
POSITIVE_NUMBERS: list[tuple[Build, str]] = [
    (lambda v: EngineConfig.from_dict({"device_memory_gb": v}), "device_memory_gb"),
    (lambda v: GatewayConfig.from_dict({"queue_timeout_s": v}), "gateway.queue_timeout_s"),
    (lambda v: TenantLimits(queue_timeout_s=v), "queue_timeout_s"),  # type: ignore[arg-type]
    (lambda v: TenantInfo("acme", weight=v), "weight"),  # type: ignore[arg-type]
    (lambda v: LoadShape(speed=v), "speed"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("bad", [True, 0, -1, 1.5, "8", math.nan, math.inf])
@pytest.mark.parametrize(("build", "name"), COUNTS, ids=[name for _, name in COUNTS])
def test_every_surface_refuses_a_bad_count_the_same_way(build: Build, name: str,
                                                        bad: object) -> None:
    with pytest.raises(ValueError) as info:
        build(bad)
    assert f"{name} must be a positive integer, got {bad!r}" in str(info.value)


@pytest.mark.parametrize(("bad", "wanted"), [
    (0, "> 0"), (-1.0, "> 0"), (True, "a finite number > 0"), ("8", "a finite number > 0"),
    (math.nan, "a finite number > 0"), (math.inf, "a finite number > 0"),
])
@pytest.mark.parametrize(("build", "name"), POSITIVE_NUMBERS,
                         ids=[name for _, name in POSITIVE_NUMBERS])
def test_every_surface_refuses_a_bad_positive_number_the_same_way(
        build: Build, name: str, bad: object, wanted: str) -> None:
    with pytest.raises(ValueError) as info:
        build(bad)
    assert f"{name} must be {wanted}, got {bad!r}" in str(info.value)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: EngineConfig.from_dict({"max_num_seq": 8}), "did you mean max_num_seqs?"),
    (lambda: GatewayConfig.from_dict({"prot": 80}), "unknown gateway setting(s): prot; "
                                                    "did you mean port?"),
    (lambda: _backend("max_inflights", 8), "unknown gateway.backends setting(s): max_inflights; "
                                           "did you mean max_inflight?"),
    (lambda: GatewayConfig.from_dict({"backends": [{"kind": "openai"}]}),
     "missing gateway.backends setting(s): url"),
    (lambda: EngineConfig.from_dict({"policy": "fiar"}), "did you mean fair?"),
])
def test_every_surface_names_a_misspelt_key(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)
