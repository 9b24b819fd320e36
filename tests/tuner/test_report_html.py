"""report.html's pieces (SVG plots, tables, the page) and the `fairgate tune` progress bar."""

from __future__ import annotations

import io
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from html.parser import HTMLParser

import pytest

from tuner.progress import CLEAR, ProgressBar
from tuner.report_html import (
    HistoryPoint,
    ScatterPoint,
    bar_chart,
    best_so_far,
    history_plot,
    html_page,
    list_html,
    nice_domain,
    scatter_plot,
    si,
    table_html,
    tick_labels,
)

SVG = "{http://www.w3.org/2000/svg}"
NAN, INF = math.nan, math.inf
COORDS = ("x", "y", "x1", "y1", "x2", "y2", "cx", "cy")
SIZES = ("width", "height", "r")

HISTORY = [
    HistoryPoint(0, 5.0, True, "default"),
    HistoryPoint(1, 7.5, True, None),
    HistoryPoint(2, None, False, None),
    HistoryPoint(3, 6.0, True, None),
    HistoryPoint(4, 2.0, False, "vllm-grid 128x2048"),
    HistoryPoint(5, 9.25, True, None),
    HistoryPoint(6, 12.0, False, None),  # a value, but it missed the SLOs: not a best
]
FRONT = [
    ScatterPoint(0.20, 900.0, True, "#3"),
    ScatterPoint(0.35, 1500.0, True, "#5"),
    ScatterPoint(0.30, 800.0, False, "#1"),
    ScatterPoint(0.50, 1600.0, True, "#7"),
]


def parse_svg(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def svg_text(root: ET.Element) -> str:
    return " ".join("".join(e.itertext()) for e in root.iter() if e.tag in (f"{SVG}text",
                                                                           f"{SVG}title"))


def view_box(root: ET.Element) -> tuple[float, float]:
    x0, y0, width, height = (float(v) for v in root.attrib["viewBox"].split())
    assert (x0, y0) == (0, 0)
    return width, height


def coordinates(root: ET.Element) -> Iterator[tuple[str, float, float]]:
    """(attribute, x or y value, the viewBox's extent on that axis) for every coordinate."""
    width, height = view_box(root)
    for element in root.iter():
        for name in COORDS:
            if name in element.attrib:
                yield name, float(element.attrib[name]), width if "x" in name else height
        for pair in element.attrib.get("points", "").split():
            x, y = pair.split(",")
            yield "points", float(x), width
            yield "points", float(y), height


def assert_valid_svg(svg: str) -> ET.Element:
    root = parse_svg(svg)
    assert root.find(f"{SVG}path") is None  # every shape here is checked by `coordinates`
    found = list(coordinates(root))
    assert found, "an SVG with nothing in it"
    for name, value, extent in found:
        assert math.isfinite(value), (name, value)
        assert 0 <= value <= extent, (name, value, extent)
    for element in root.iter():
        for name in SIZES:
            if name in element.attrib:
                assert math.isfinite(float(element.attrib[name]))
                assert float(element.attrib[name]) >= 0
    return root


def polyline(root: ET.Element, cls: str) -> list[tuple[float, float]]:
    (line,) = [e for e in root.iter(f"{SVG}polyline") if e.get("class") == cls]
    return [(float(x), float(y)) for x, y in (p.split(",") for p in line.attrib["points"].split())]


# numbers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "text"), [
    (0.0, "0"), (9.18, "9.18"), (0.25, "0.25"), (999.7, "1k"), (1234.0, "1.23k"),
    (12000.0, "12k"), (-2500.0, "-2.5k"), (3.2e6, "3.2M"), (7e9, "7G"), (NAN, "n/a"),
    (INF, "n/a"),
])
def test_si(value: float, text: str) -> None:
    assert si(value) == text


@pytest.mark.parametrize(("lo", "hi", "integer"), [
    (0, 9.18, False), (0.2, 0.5, False), (12000, 12600, False), (5, 5, False), (0, 0, False),
    (-3, 7, False), (0, 29, True), (4, 4, True), (1e-300, 1e-300, False), (-1e300, 1e300, False),
    (1, 1 + 1e-15, False), (5e-324, 5e-324, False),
])
def test_nice_domain_covers_the_data_with_few_distinct_ticks(lo: float, hi: float,
                                                             integer: bool) -> None:
    start, end, ticks = nice_domain(lo, hi, integer=integer)
    assert start < end
    assert 2 <= len(ticks) <= 12
    assert all(math.isfinite(t) for t in (start, end, *ticks))
    assert list(ticks) == sorted(ticks)
    if abs(hi) < 1e12 and abs(lo) < 1e12:
        assert start <= lo and hi <= end
    if integer:
        assert all(t == int(t) for t in ticks)
    if lo >= 0:
        assert start >= 0  # no negative axis under non-negative data


def test_tick_labels_get_more_digits_only_when_needed() -> None:
    assert tick_labels([0.0, 0.1 * 3, 0.6]) == ["0", "0.3", "0.6"]
    assert tick_labels([12000.0, 12500.0, 13000.0]) == ["12k", "12.5k", "13k"]
    assert len(set(tick_labels([1_000_000.0, 1_000_250.0, 1_000_500.0]))) == 3


# the optimisation history -----------------------------------------------------------------------

def test_history_plot_is_valid_svg_with_a_non_decreasing_best_line() -> None:
    root = assert_valid_svg(history_plot(HISTORY, y_label="goodput (req/s)"))
    line = polyline(root, "best")
    ys = [y for _, y in line]
    assert all(later <= earlier for earlier, later in zip(ys, ys[1:], strict=False))  # y is down
    xs = [x for x, _ in line]
    assert xs == sorted(xs)
    assert ys[-1] < ys[0]  # it rose: 5 -> 9.25


def test_best_so_far_counts_only_feasible_values() -> None:
    assert best_so_far(HISTORY) == [(0, 5.0), (1, 7.5), (2, 7.5), (3, 7.5), (4, 7.5), (5, 9.25),
                                    (6, 9.25)]
    assert best_so_far([HistoryPoint(0, None, False, None), HistoryPoint(1, 3.0, True, None),
                        HistoryPoint(2, NAN, True, None)]) == [(1, 3.0), (2, 3.0)]


def test_history_plot_marks_each_kind_of_trial_and_has_a_legend() -> None:
    root = assert_valid_svg(history_plot(HISTORY))
    dots = list(root.iter(f"{SVG}circle"))
    diamonds = list(root.iter(f"{SVG}polygon"))
    text = svg_text(root)
    assert len(dots) == 3 + 1  # trials 1, 3, 5, plus the legend's
    assert len(diamonds) == 2 + 1  # default, vllm-grid, plus the legend's
    for name in ("feasible", "infeasible", "best so far", "baseline"):
        assert name in text
    assert "#0 default" in text and "#4 vllm-grid 128x2048" in text  # the baselines' tooltips
    names = [e.text for e in root.iter(f"{SVG}text")]
    assert "default" in names and "vllm-grid 128x2048" in names  # named beside their markers

    hollow = [d for d in diamonds if d.get("fill") == "white"]
    assert len(hollow) == 1  # the infeasible vllm-grid trial


def test_history_plot_of_one_trial_has_no_best_line() -> None:
    root = assert_valid_svg(history_plot([HistoryPoint(3, 4.0, True, None)]))
    assert root.find(f"{SVG}polyline") is None
    assert "best so far" not in svg_text(root)


def test_infeasible_trial_without_a_value_sits_on_zero() -> None:
    root = assert_valid_svg(history_plot([HistoryPoint(0, None, False, None),
                                          HistoryPoint(1, 4.0, True, None)]))
    zero_label = next(e for e in root.iter(f"{SVG}text") if e.text == "0"
                      and e.get("text-anchor") == "end")
    cross = next(g for g in root.iter(f"{SVG}g") if "#0" in "".join(g.itertext()))
    lines = cross.findall(f"{SVG}line")
    mid = sum(float(e.attrib["y1"]) + float(e.attrib["y2"]) for e in lines) / 4
    assert mid == pytest.approx(float(zero_label.get("y", "0")) - 4, abs=0.2)


@pytest.mark.parametrize("points", [
    [],
    [HistoryPoint(0, 3.0, True, None)],
    [HistoryPoint(7, None, False, None)],
    [HistoryPoint(0, NAN, True, None), HistoryPoint(1, INF, True, None),
     HistoryPoint(2, -INF, False, "default")],
    [HistoryPoint(i, 4.0, True, None) for i in range(5)],  # all equal
    [HistoryPoint(0, 1e300, True, None), HistoryPoint(1, -1e300, True, None)],
    [HistoryPoint(0, 0.0, False, None), HistoryPoint(100_000, 0.0, True, None)],
])
def test_history_plot_edge_cases_stay_valid(points: list[HistoryPoint]) -> None:
    svg = history_plot(points)
    root = assert_valid_svg(svg)
    assert "nan" not in svg.lower()
    assert "inf" not in "".join(f"{k}={v}" for e in root.iter() for k, v in e.attrib.items())


# scatter ----------------------------------------------------------------------------------------

def test_scatter_plot_joins_the_front_in_x_order_and_emphasises_it() -> None:
    root = assert_valid_svg(scatter_plot(FRONT, "p99 TTFT (s)", "output tokens/s"))
    line = polyline(root, "front")
    assert len(line) == 3
    assert [x for x, _ in line] == sorted(x for x, _ in line)
    radii = {float(c.attrib["r"]) for c in root.iter(f"{SVG}circle")}
    assert len(radii) == 2
    text = svg_text(root)
    assert "p99 TTFT (s)" in text and "output tokens/s" in text and "Pareto front" in text
    assert "#5: p99 TTFT (s) 0.35, output tokens/s 1500" in text
    assert "1.2k" in text  # a y tick


@pytest.mark.parametrize("points", [
    [],
    [ScatterPoint(NAN, 1.0, True, None), ScatterPoint(1.0, INF, False, None)],
    [ScatterPoint(0.3, 1000.0, True, "only")],
    [ScatterPoint(0.3, 1000.0, False, None)] * 3,
    [ScatterPoint(NAN, 1.0, True, None), ScatterPoint(0.1, 10.0, True, None)],
])
def test_scatter_plot_edge_cases_stay_valid(points: list[ScatterPoint]) -> None:
    svg = scatter_plot(points, "x", "y")
    assert_valid_svg(svg)
    assert "nan" not in svg.lower()


# bars -------------------------------------------------------------------------------------------

def test_bar_chart_lengths_follow_the_values_and_values_are_written() -> None:
    bars = [("max_num_seqs", 0.6), ("max_num_batched_tokens", 0.3), ("block_size", 0.1)]
    root = assert_valid_svg(bar_chart(bars, "importance"))
    widths = [float(r.attrib["width"]) for r in root.iter(f"{SVG}rect")]
    assert widths[0] > widths[1] > widths[2] > 0
    assert widths[0] / widths[2] == pytest.approx(6, rel=0.01)
    text = svg_text(root)
    for name, value in bars:
        assert name in text and si(value) in text
    assert "importance" in text


@pytest.mark.parametrize("bars", [
    [],
    [("only", 0.0)],
    [("a", NAN), ("b", INF), ("c", 2.0)],
    [("loss", -3.0), ("gain", 5.0)],
    [("x" * 200, 1.0)],  # a long label is cut, not pushed off the picture
    [(f"config {i}", 1.0) for i in range(40)],
])
def test_bar_chart_edge_cases_stay_valid(bars: list[tuple[str, float]]) -> None:
    svg = bar_chart(bars, "goodput (req/s)")
    assert_valid_svg(svg)
    assert "nan" not in svg.lower()


# escaping ---------------------------------------------------------------------------------------

EVIL = '<script>alert("x")</script> & co'


@pytest.mark.parametrize("make", [
    lambda: history_plot([HistoryPoint(0, 1.0, True, EVIL)], y_label=EVIL),
    lambda: scatter_plot([ScatterPoint(1.0, 2.0, True, EVIL)], EVIL, EVIL, title=EVIL),
    lambda: bar_chart([(EVIL, 1.0)], EVIL, title=EVIL),
    lambda: table_html([EVIL], [[EVIL]]),
    lambda: list_html([EVIL]),
    lambda: html_page(EVIL, [(EVIL, "<p>trusted</p>")]),
])
def test_text_is_escaped(make: Callable[[], str]) -> None:
    out = make()
    assert "<script" not in out
    assert "&lt;script&gt;" in out and "&amp; co" in out
    if out.startswith("<svg"):
        assert EVIL in svg_text(assert_valid_svg(out))  # escaped in the markup, intact to read


# the page ---------------------------------------------------------------------------------------

class _Outline(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.headings: list[str] = []
        self.title = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag not in ("meta", "link", "br", "hr", "img", "input"):  # HTML's void elements
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, (self.stack[-3:], tag)
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        if self.stack and self.stack[-1] in ("h1", "h2"):
            self.headings.append(data)
        if self.stack and self.stack[-1] == "title" and "head" in self.stack:
            self.title += data


def test_html_page_is_well_formed_and_has_every_section() -> None:
    sections = [
        ("Optimisation history", history_plot(HISTORY)),
        ("Pareto front", scatter_plot(FRONT, "p99 TTFT (s)", "output tokens/s")),
        ("Parameter importances", bar_chart([("max_num_seqs", 0.7)], "importance")),
        ("Best vs default", table_html(["", "goodput"], [["best", "9.25 req/s"],
                                                         ["default", "5 req/s"]])),
        ("Notes", list_html(["sim mode", "36 requests"])),
    ]
    page = html_page("fairgate tune: s", sections)
    assert page.startswith("<!DOCTYPE html>")
    outline = _Outline()
    outline.feed(page)
    outline.close()
    assert outline.stack == []  # every element closed, in order
    assert outline.title == "fairgate tune: s"
    assert outline.headings == ["fairgate tune: s"] + [heading for heading, _ in sections]
    assert outline.tags.count("svg") == 3 and outline.tags.count("table") == 1
    assert "max-width: 1100px" in page
    assert not re.search(r"<script|https?://(?!www\.w3\.org/2000/svg)", page)  # offline


def test_table_html_right_aligns_numbers_only() -> None:
    table = table_html(["knob", "value"], [["max_num_seqs", "128"], ["goodput", "9.2 req/s"],
                                           ["policy", "fcfs"]])
    assert '<td class="num">128</td>' in table and '<td class="num">9.2 req/s</td>' in table
    assert "<td>max_num_seqs</td>" in table and "<td>fcfs</td>" in table


# the progress bar -------------------------------------------------------------------------------

class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


BEST = "best goodput 9.18 req/s (#7)"


def test_progress_bar_off_a_tty_writes_whole_lines() -> None:
    stream = io.StringIO()
    bar = ProgressBar(30, stream)
    bar.start(11, "max_num_seqs=64")
    bar.finish(11, "goodput 9.18 req/s, feasible", BEST)
    bar.start(12, "max_num_seqs=128")
    bar.close()
    assert stream.getvalue() == (
        "trial 1/30 (#11) running: max_num_seqs=64\n"
        f"trial 1/30 (#11): goodput 9.18 req/s, feasible | {BEST}\n"
        "trial 2/30 (#12) running: max_num_seqs=128\n"
    )
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_progress_bar_off_a_tty_without_a_total() -> None:
    stream = io.StringIO()
    with ProgressBar(None, stream) as bar:
        bar.start(0, "default")
        bar.finish(0, "infeasible (ttft)", "no feasible trial yet")
        bar.note("stopping: timeout")
    assert stream.getvalue().splitlines() == [
        "trial 1 (#0) running: default",
        "trial 1 (#0): infeasible (ttft) | no feasible trial yet",
        "stopping: timeout",
    ]


def test_progress_bar_on_a_tty_redraws_one_line() -> None:
    stream = FakeTTY()
    bar = ProgressBar(30, stream, width=14, columns=200)
    for number in range(12):
        bar.start(number, "")
        bar.finish(number, f"result {number}", BEST)
    bar.start(12, "")
    out = stream.getvalue()
    assert out.endswith(CLEAR + f"[#####---------] 12/30 trials | {BEST} | running #12")
    assert out.count("\n") == 12  # the results only; the status line is redrawn in place
    assert f"{CLEAR}trial 12/30 (#11): result 11\n" in out
    bar.close()
    assert stream.getvalue().endswith(f"{CLEAR}[#####---------] 12/30 trials | {BEST}\n")
    bar.close()  # idempotent
    assert stream.getvalue().count("\n") == 13


def test_progress_bar_on_a_tty_without_a_total_shows_elapsed_time() -> None:
    stream, clock = FakeTTY(), FakeClock()
    bar = ProgressBar(None, stream, clock=clock, columns=200)
    clock.now += 185
    bar.start(3, "max_num_seqs=256")
    assert stream.getvalue() == f"{CLEAR}0 trials | 3m05s | running #3: max_num_seqs=256"


def test_progress_bar_on_a_tty_fits_the_terminal_and_keeps_notes() -> None:
    stream = FakeTTY()
    bar = ProgressBar(4, stream, columns=40)
    bar.start(0, "x" * 100)
    bar.note("study resumed: 3 trials already done")
    drawn = stream.getvalue().split("\r")
    assert all(len(part.split("\n")[-1]) <= 40 + len("\x1b[K") for part in drawn)
    assert "\nstudy resumed: 3 trials already done\n" in stream.getvalue() or \
        f"{CLEAR}study resumed: 3 trials already done\n" in stream.getvalue()
    assert stream.getvalue().endswith("\u2026")  # the redrawn, cut status line


def test_progress_bar_with_parallel_trials_lists_what_runs() -> None:
    stream = FakeTTY()
    bar = ProgressBar(10, stream, width=10, columns=200)
    bar.start(0, "a")
    bar.start(1, "b")
    assert stream.getvalue().endswith("[----------] 0/10 trials | running #0, #1")
    bar.finish(1, "done", BEST)
    assert stream.getvalue().endswith(f"[#---------] 1/10 trials | {BEST} | running #0: a")
