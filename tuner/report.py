"""What a load test measured: one `RequestResult` per request, summed up in a `Report`.

The measures are defined in `protocol.measures`, as for the engine's `/stats` and the gateway:
TTFT = send to first token; ITL = every gap between two token stamps (the client stamps each token
with the time of the network read that brought it); TPOT = (last token - first token) / (output
tokens - 1), which is vLLM's (e2e - TTFT) / (output tokens - 1) when the last token ends the
stream; e2e = send to last byte.

The SLOs have vLLM's names. Goodput (`vllm bench serve --goodput ttft:.. tpot:..`) counts the
requests that succeeded with TTFT within `slo_ttft` and TPOT within `slo_tpot`. `slo_itl` bounds
every gap instead: ITL attainment is the share of all the run's gaps within it, a failed request
counting as misses (`RequestTiming.gaps_within`); it is not part of goodput.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from protocol.measures import SLO, RequestTiming, attainment, goodput, summarize

OK = "ok"


@dataclass(slots=True)
class RequestResult:
    index: int
    tenant: str
    priority: str | None
    scheduled: float  # planned send time, seconds from the run's start
    start: float = 0.0  # actual send time (later than scheduled when concurrency is capped)
    status: str = OK  # "ok", "HTTP 429", "connection error", "timeout", "stream error"
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def timing(self) -> RequestTiming | None:
        """Times from the send (start 0): token stamps rebuilt from TTFT and the gaps. None when
        the request never got its first token and end."""
        if self.ttft is None or self.e2e is None:
            return None
        stamps = list(accumulate(self.itl, initial=self.ttft))
        return RequestTiming(0.0, stamps, self.output_tokens, self.e2e, self.ok)

    @property
    def tpot(self) -> float | None:
        timing = self.timing
        return None if timing is None else timing.tpot

    def meets(self, slo: SLO) -> bool:
        """Counts toward goodput: succeeded within `slo`'s TTFT and TPOT."""
        timing = self.timing
        return timing is not None and timing.meets(slo)

    def gaps_within(self, slo: SLO) -> tuple[int, int]:
        """(gaps within `slo.itl_s`, gaps): this request's part of the ITL attainment. One that
        failed before its first token had no gap and counts one miss."""
        timing = self.timing or RequestTiming(0.0, (), 0, 0.0, self.ok)
        return timing.gaps_within(slo)

    def row(self) -> dict[str, Any]:
        itl = self.itl
        return {
            "index": self.index,
            "tenant": self.tenant,
            "priority": self.priority or "",
            "scheduled_s": _r(self.scheduled),
            "start_s": _r(self.start),
            "status": self.status,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": _r(self.ttft),
            "tpot_s": _r(self.tpot),
            "e2e_s": _r(self.e2e),
            "itl_mean_s": _r(sum(itl) / len(itl)) if itl else None,
            "itl_max_s": _r(max(itl)) if itl else None,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 in milliseconds (None when there is nothing to measure)."""
    ms = summarize(v * 1000.0 for v in values)
    return {"mean_ms": ms["mean"], "median_ms": ms["p50"], "p90_ms": ms["p90"], "p99_ms": ms["p99"]}


@dataclass
class Summary:
    """Aggregates over a set of results (the whole run or one tenant)."""

    completed: int
    failed: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # None without a TTFT or TPOT target
    itl_attainment: dict[str, int | float | None] | None  # gaps, met, fraction; None: no slo_itl
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]

    @classmethod
    def of(
        cls,
        results: Sequence[RequestResult],
        duration: float,
        slo: SLO,
    ) -> Summary:
        ok = [r for r in results if r.ok]
        timings = [timing for r in ok if (timing := r.timing) is not None]
        per_s = 1.0 / duration if duration > 0 else 0.0
        inp = sum(r.prompt_tokens for r in ok)
        out = sum(r.output_tokens for r in ok)
        good = goodput(timings, duration, slo)
        per_request = slo.ttft_s is not None or slo.tpot_s is not None
        return cls(
            completed=len(ok),
            failed=dict(Counter(r.status for r in results if not r.ok).most_common()),
            input_tokens=inp,
            output_tokens=out,
            request_throughput=len(ok) * per_s,
            output_throughput=out * per_s,
            total_token_throughput=(inp + out) * per_s,
            goodput=good.requests_per_s if per_request else None,
            itl_attainment=itl_attainment(results, slo),
            ttft=latency_stats([r.ttft for r in ok if r.ttft is not None]),
            tpot=latency_stats([tpot for x in timings if (tpot := x.tpot) is not None]),
            itl=latency_stats([g for r in ok for g in r.itl]),
            e2e=latency_stats([r.e2e for r in ok if r.e2e is not None]),
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def itl_attainment(results: Sequence[RequestResult], slo: SLO) -> dict[str, Any] | None:
    """Every gap between tokens of `results`, pooled, and how many were within `slo.itl_s`:
    "p99 ITL <= slo_itl" holds when fraction >= 0.99. None without an ITL target."""
    if slo.itl_s is None:
        return None
    met = gaps = 0
    for r in results:
        m, n = r.gaps_within(slo)
        met, gaps = met + m, gaps + n
    return {"gaps": gaps, "met": met, "fraction": attainment(met, gaps, slo.target)["fraction"]}


@dataclass
class Report:
    results: list[RequestResult]
    duration: float
    slo_ttft: float | None = None  # seconds, each request's (goodput)
    slo_tpot: float | None = None  # seconds, each request's (goodput)
    slo_itl: float | None = None  # seconds, every gap (ITL attainment)
    config: dict[str, Any] = field(default_factory=dict)
    total: Summary = field(init=False)
    tenants: dict[str, Summary] = field(init=False)
    errors: dict[str, str] = field(init=False)  # status -> first message seen

    def __post_init__(self) -> None:
        self.total = Summary.of(self.results, self.duration, self.slo)
        names = sorted({r.tenant for r in self.results})
        self.tenants = (
            {
                name: Summary.of(
                    [r for r in self.results if r.tenant == name], self.duration, self.slo
                )
                for name in names
            }
            if len(names) > 1
            else {}
        )
        self.errors = {}
        for r in self.results:
            if not r.ok:
                self.errors.setdefault(r.status, r.error)

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft, self.slo_tpot, self.slo_itl)

    @property
    def failed(self) -> int:
        return sum(self.total.failed.values())

    def to_json(self, with_requests: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": self.config,
            "duration_s": self.duration,
            "slo": {"ttft_s": self.slo_ttft, "tpot_s": self.slo_tpot, "itl_s": self.slo_itl},
            **self.total.to_json(),
            "errors": self.errors,
            "tenants": {name: s.to_json() for name, s in self.tenants.items()},
        }
        if with_requests:
            out["requests"] = [
                {**r.row(), "itl_s": [round(g, 6) for g in r.itl]} for r in self.results
            ]
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    def write_csv(self, path: str | Path) -> None:
        fields = list(RequestResult(0, "", None, 0.0).row())
        with Path(path).open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(r.row() for r in self.results)

    def format(self) -> str:
        return format_report(self)


# ----------------------------------------------------------------------------- text


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = "n/a" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<40} {value}"


def _heading(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^50}"


def _latency_block(title: str, short: str, stats: dict[str, float | None]) -> list[str]:
    names = {"mean_ms": "Mean", "median_ms": "Median", "p90_ms": "P90", "p99_ms": "P99"}
    return [_heading(title)] + [
        _line(f"{names[k]} {short} (ms):", float("nan") if v is None else v)
        for k, v in stats.items()
    ]


def format_report(report: Report) -> str:
    t = report.total
    lines = [
        _heading(" Serving Benchmark Result ", "="),
        _line("Successful requests:", t.completed),
        _line("Failed requests:", report.failed),
    ]
    for status, count in t.failed.items():
        lines.append(_line(f"  {status}:", f"{count}  ({_hint(status, report.errors[status])})"))
    lines += [
        _line("Benchmark duration (s):", report.duration),
        _line("Total input tokens:", t.input_tokens),
        _line("Total generated tokens:", t.output_tokens),
        _line("Request throughput (req/s):", t.request_throughput),
        _line("Output token throughput (tok/s):", t.output_throughput),
        _line("Total token throughput (tok/s):", t.total_token_throughput),
    ]
    if t.goodput is not None:
        lines.append(_line(f"Request goodput (req/s) [{_slo_text(report)}]:", t.goodput))
    if t.itl_attainment is not None and report.slo_itl is not None:
        lines.append(_line(f"ITL attainment [ITL<={report.slo_itl * 1000:g}ms]:",
                           _share_text(t.itl_attainment)))
    lines += _latency_block("Time to First Token", "TTFT", t.ttft)
    lines += _latency_block("Time per Output Token (excl. 1st token)", "TPOT", t.tpot)
    lines += _latency_block("Inter-token Latency", "ITL", t.itl)
    lines += _latency_block("End-to-end Latency", "E2E", t.e2e)
    if report.tenants:
        lines += _tenant_table(report)
    lines.append("=" * 50)
    return "\n".join(lines)


def _slo_text(report: Report) -> str:
    parts = []
    if report.slo_ttft is not None:
        parts.append(f"TTFT<={report.slo_ttft * 1000:g}ms")
    if report.slo_tpot is not None:
        parts.append(f"TPOT<={report.slo_tpot * 1000:g}ms")
    return " ".join(parts)


def _share_text(share: dict[str, Any]) -> str:
    """'98.50% (197 of 200 gaps)'; 'n/a (0 gaps)' when there were none."""
    fraction = share["fraction"]
    percent = "n/a" if fraction is None else f"{fraction:.2%}"
    return f"{percent} ({share['met']} of {share['gaps']} gaps)"


def _hint(status: str, message: str) -> str:
    hints = {
        "HTTP 401": "unauthorized: check --api-key or the tenant keys",
        "HTTP 429": "rate limited or queue full: lower --rate or raise the tenant's limits",
        "connection error": "is the server running at --url?",
    }
    text = message.strip().replace("\n", " ")[:200]
    hint = hints.get(status)
    return f"{hint}; {text}" if hint and text else hint or text or "no message"


def _tenant_table(report: Report) -> list[str]:
    head = (
        f"{'tenant':<14}{'ok':>6}{'fail':>6}{'req/s':>8}{'tok/s':>9}{'good/s':>8}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    )
    lines = [_heading("Per tenant (latencies in ms)"), head]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for name, s in report.tenants.items():
        good = "-" if s.goodput is None else f"{s.goodput:.2f}"
        lines.append(
            f"{name[:13]:<14}{s.completed:>6}{sum(s.failed.values()):>6}"
            f"{s.request_throughput:>8.2f}{s.output_throughput:>9.1f}{good:>8}"
            f"{ms(s.ttft['median_ms']):>10}{ms(s.ttft['p99_ms']):>10}"
            f"{ms(s.itl['median_ms']):>9}{ms(s.itl['p99_ms']):>9}"
        )
    return lines
