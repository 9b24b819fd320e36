"""The pieces of report.html: inline SVG plots, tables, lists and the page around them.

Everything is a pure function returning a string, so the page works offline (no CDN, no JavaScript)
and the tests can parse what they get. Every piece of text goes through `html.escape`: labels,
cells and titles may hold knob values from a user's files. Values that are None, NaN or infinite
are never drawn as coordinates: a missing history value is drawn at 0, a scatter point without
both coordinates is skipped, a bar without a value gets no bar and the text "n/a".
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

WIDTH, HEIGHT = 760, 380
LEFT, RIGHT, TOP, BOTTOM = 64, 20, 34, 48  # plot margins: tick labels, legend, axis labels
INSET = 8  # keeps markers at the ends of a domain off the axis lines
LIMIT = 1e12  # plotted values are clamped to +-LIMIT so that spans stay finite
FONT = "system-ui, -apple-system, Segoe UI, Roboto, Helvetica, Arial, sans-serif"
MAX_NAMED_BASELINES = 6  # baselines named beside their marker in the history plot
CHAR_W = 7  # rough width of a character at font-size 12, for layout only

FEASIBLE, INFEASIBLE, BEST, BASELINE = "#2563eb", "#9ca3af", "#16a34a", "#ea580c"
AXIS, GRID, MUTED = "#374151", "#e5e7eb", "#6b7280"


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    number: int  # the trial number
    value: float | None  # the objective's value; None when the trial produced none
    feasible: bool
    label: str | None = None  # a baseline trial: "default", "vllm-grid 128x2048"


@dataclass(frozen=True, slots=True)
class ScatterPoint:
    x: float
    y: float
    on_front: bool
    label: str | None = None  # shown as the point's tooltip


@dataclass(frozen=True, slots=True)
class _Axis:
    """A linear map from a data domain [lo, hi] onto pixels [start, end] (end < start for y)."""

    lo: float
    hi: float
    ticks: tuple[float, ...]
    start: float
    end: float

    def __call__(self, value: float) -> float:
        t = (value - self.lo) / (self.hi - self.lo)
        t = min(1.0, max(0.0, t)) if math.isfinite(t) else 0.0
        inset = INSET if self.end > self.start else -INSET
        return self.start + inset + t * (self.end - self.start - 2 * inset)


# numbers ----------------------------------------------------------------------------------------

def finite(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def si(value: float, digits: int = 3) -> str:
    """`digits` significant digits with k/M/G/T for large magnitudes: 1234 -> '1.23k'."""
    if not math.isfinite(value):
        return "n/a"
    value = float(f"{value:.{digits}g}")  # first round, so that 999.7 becomes '1k', not '1e+03'
    if value == 0:
        return "0"
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.{digits}g}{suffix}"
    return f"{value:.{digits}g}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """The shortest `si` labels that tell the ticks apart (12k, 12.5k, 13k)."""
    labels: list[str] = []
    for digits in range(3, 9):
        labels = [si(t, digits) for t in ticks]
        if len(set(labels)) == len(labels):
            break
    return labels


def nice_step(span: float, count: int, integer: bool = False) -> float:
    """A step of 1, 2, 2.5 or 5 times a power of ten giving about `count` intervals over `span`."""
    raw = span / max(count, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    factors = (1.0, 2.0, 5.0, 10.0) if integer else (1.0, 2.0, 2.5, 5.0, 10.0)
    step = next((f * magnitude for f in factors if f * magnitude >= raw), 10 * magnitude)
    return max(step, 1.0) if integer else step


def nice_domain(lo: float, hi: float, count: int = 5,
                integer: bool = False) -> tuple[float, float, tuple[float, ...]]:
    """[lo, hi] widened to whole steps, and the ticks; an empty span is padded first."""
    lo, hi = _clamp(min(lo, hi)), _clamp(max(lo, hi))
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi), 1.0):
        pad = abs(lo) * 0.1 if abs(lo) >= 1e-12 and not integer else 1.0
        lo, hi = (max(lo - pad, 0.0) if lo >= 0 else lo - pad), hi + pad  # no negative axis
    step = nice_step(hi - lo, count, integer)
    first, last = math.floor(lo / step), math.ceil(hi / step)
    ticks = tuple(i * step for i in range(first, last + 1))
    return first * step, last * step, ticks


def _clamp(value: float) -> float:
    return max(-LIMIT, min(LIMIT, value))


def _x_axis(lo: float, hi: float, integer: bool = False, left: float = LEFT,
            right: float = WIDTH - RIGHT) -> _Axis:
    lo, hi, ticks = nice_domain(lo, hi, count=6, integer=integer)
    return _Axis(lo, hi, ticks, left, right)


def _y_axis(lo: float, hi: float, height: float = HEIGHT) -> _Axis:
    lo, hi, ticks = nice_domain(lo, hi, count=5)
    return _Axis(lo, hi, ticks, height - BOTTOM, TOP)


# SVG elements -----------------------------------------------------------------------------------

def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _f(value: float) -> str:
    assert math.isfinite(value), value  # never "nan" or "inf" in a coordinate
    return f"{value:.1f}"


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str, width: float = 1) -> str:
    return (f'<line x1="{_f(x1)}" y1="{_f(y1)}" x2="{_f(x2)}" y2="{_f(y2)}" '
            f'stroke="{stroke}" stroke-width="{width:g}"/>')


def _text(x: float, y: float, text: str, anchor: str = "middle", fill: str = AXIS,
          extra: str = "") -> str:
    return (f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" fill="{fill}"{extra}>'
            f"{_e(text)}</text>")


def _points(coords: Iterable[tuple[float, float]]) -> str:
    return " ".join(f"{_f(x)},{_f(y)}" for x, y in coords)


def _tooltip(text: str) -> str:
    return f"<title>{_e(text)}</title>"


def _dot(x: float, y: float, r: float, fill: str, stroke: str, tip: str) -> str:
    return (f'<circle cx="{_f(x)}" cy="{_f(y)}" r="{r:g}" fill="{fill}" stroke="{stroke}" '
            f'stroke-width="1.5">{_tooltip(tip)}</circle>')


def _cross(x: float, y: float, tip: str, size: float = 4) -> str:
    return (f"<g>{_tooltip(tip)}{_line(x - size, y - size, x + size, y + size, INFEASIBLE, 2)}"
            f"{_line(x - size, y + size, x + size, y - size, INFEASIBLE, 2)}</g>")


def _diamond(x: float, y: float, fill: str, tip: str, size: float = 6) -> str:
    corners = [(x, y - size), (x + size, y), (x, y + size), (x - size, y)]
    return (f'<polygon points="{_points(corners)}" fill="{fill}" stroke="{BASELINE}" '
            f'stroke-width="2">{_tooltip(tip)}</polygon>')


def _svg(title: str, body: Sequence[str], height: float = HEIGHT) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" viewBox="0 0 {WIDTH} '
            f'{_f(height)}" width="{WIDTH}" height="{_f(height)}" role="img" '
            f'aria-label="{_e(title)}" font-family="{FONT}" font-size="12">'
            f"{_tooltip(title)}" + "".join(body) + "</svg>")


def _empty(title: str, message: str) -> str:
    return _svg(title, [_text(WIDTH / 2, 60, message, fill=MUTED)], height=120)


def _axes(x: _Axis, y: _Axis, x_label: str, y_label: str) -> list[str]:
    """Grid lines, tick labels, the two axis lines and their labels."""
    left, right, bottom, top = x.start, x.end, y.start, y.end
    out = []
    for tick, label in zip(y.ticks, tick_labels(y.ticks), strict=True):
        out.append(_line(left, y(tick), right, y(tick), GRID))
        out.append(_text(left - 6, y(tick) + 4, label, anchor="end"))
    for tick, label in zip(x.ticks, tick_labels(x.ticks), strict=True):
        out.append(_line(x(tick), bottom, x(tick), bottom + 5, AXIS))
        out.append(_text(x(tick), bottom + 18, label))
    out += [_line(left, bottom, right, bottom, AXIS), _line(left, bottom, left, top, AXIS)]
    out.append(_text((left + right) / 2, bottom + 38, x_label))
    mid = (top + bottom) / 2
    out.append(_text(16, mid, y_label, extra=f' transform="rotate(-90 16 {_f(mid)})"'))
    return out


def _legend(entries: Sequence[tuple[str, str]], y: float = 16) -> list[str]:
    """(marker kind, text) pairs in one row above the plot, right-aligned."""
    widths = [24 + CHAR_W * len(text) for _, text in entries]
    x = WIDTH - RIGHT - sum(widths)
    out = []
    for (kind, text), width in zip(entries, widths, strict=True):
        out.append(_LEGEND_MARKERS[kind](x + 6, y))
        out.append(_text(x + 16, y + 4, text, anchor="start"))
        x += width
    return out


_LEGEND_MARKERS = {
    "feasible": lambda x, y: _dot(x, y, 4, FEASIBLE, FEASIBLE, "feasible"),
    "infeasible": lambda x, y: _cross(x, y, "infeasible"),
    "best": lambda x, y: _line(x - 7, y, x + 7, y, BEST, 2),
    "baseline": lambda x, y: _diamond(x, y, BASELINE, "baseline", size=5),
    "front": lambda x, y: _dot(x, y, 5, BASELINE, AXIS, "Pareto front"),
    "other": lambda x, y: _dot(x, y, 3.5, INFEASIBLE, INFEASIBLE, "other trials"),
}


# optimisation history ---------------------------------------------------------------------------

def best_so_far(points: Sequence[HistoryPoint]) -> list[tuple[int, float]]:
    """(trial number, best feasible value up to it) for every trial from the first feasible one."""
    out: list[tuple[int, float]] = []
    for point in sorted(points, key=lambda p: p.number):
        best = out[-1][1] if out else None
        if point.feasible and finite(point.value):
            best = point.value if best is None else max(best, point.value)
        if best is not None:
            out.append((point.number, best))
    return out


def history_plot(points: Sequence[HistoryPoint], y_label: str = "objective",
                 x_label: str = "trial") -> str:
    """Each trial's value (dots; crosses when infeasible, at 0 without a value), a step line of
    the best feasible value so far, baseline trials as diamonds."""
    title = "optimisation history"
    if not points:
        return _empty(title, "no trials yet")
    numbers = [p.number for p in points]
    values = [_clamp(p.value) for p in points if finite(p.value)] + [0.0]
    x, y = _x_axis(min(numbers), max(numbers), integer=True), _y_axis(min(values), max(values))
    body = _axes(x, y, x_label, y_label)
    steps = _steps(best_so_far(points))
    if len(steps) > 1:
        line = _points((x(n), y(_clamp(v))) for n, v in steps)
        body.append(f'<polyline class="best" points="{line}" fill="none" stroke="{BEST}" '
                    f'stroke-width="2">{_tooltip("best feasible so far")}</polyline>')
    ordered = sorted(points, key=lambda p: p.label is not None)  # baselines on top
    body += [_history_marker(p, x, y, y_label) for p in ordered]
    baselines = [p for p in points if p.label is not None]
    if len(baselines) <= MAX_NAMED_BASELINES:  # more would hide the trials; tooltips remain
        body += [_baseline_name(p, x, y) for p in baselines]
    return _svg(title, body + _legend(_history_legend(points, len(steps) > 1)))


def _steps(best: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The corners of a step line through `best_so_far`: flat until the best improves."""
    out = list(best[:1])
    for number, value in best[1:]:
        if value != out[-1][1]:
            out.append((number, out[-1][1]))
        out.append((number, value))
    return out


def _history_marker(point: HistoryPoint, x: _Axis, y: _Axis, y_label: str) -> str:
    value = point.value if finite(point.value) else None
    cx, cy = x(point.number), y(_clamp(value) if value is not None else 0.0)
    shown = "no value" if value is None else f"{y_label} {value:.4g}"
    name = f"#{point.number}" + (f" {point.label}" if point.label is not None else "")
    tip = f"{name}: {shown}" + ("" if point.feasible else ", infeasible")
    if point.label is not None:
        return _diamond(cx, cy, BASELINE if point.feasible else "white", tip)
    if point.feasible and value is not None:
        return _dot(cx, cy, 4, FEASIBLE, FEASIBLE, tip)
    return _cross(cx, cy, tip)


def _baseline_name(point: HistoryPoint, x: _Axis, y: _Axis) -> str:
    cx, cy = x(point.number), y(_clamp(point.value) if finite(point.value) else 0.0)
    anchor, dx = ("end", -9) if cx > WIDTH * 0.75 else ("start", 9)
    return _text(cx + dx, max(cy - 6, 12), point.label or "", anchor, BASELINE,
                 ' font-size="11"')


def _history_legend(points: Sequence[HistoryPoint], has_best: bool) -> list[tuple[str, str]]:
    trials = [p for p in points if p.label is None]
    entries = [("feasible", "feasible")] if any(p.feasible for p in trials) else []
    if any(not p.feasible for p in trials):
        entries.append(("infeasible", "infeasible"))
    if has_best:
        entries.append(("best", "best so far"))
    baselines = [p for p in points if p.label is not None]
    if baselines:
        hollow = any(not p.feasible for p in baselines)
        entries.append(("baseline", "baseline (hollow: infeasible)" if hollow else "baseline"))
    return entries


# scatter (the Pareto front) ---------------------------------------------------------------------

def scatter_plot(points: Sequence[ScatterPoint], x_label: str, y_label: str,
                 title: str = "Pareto front") -> str:
    """Points with both coordinates finite; those on the front larger and joined by a line."""
    shown = [p for p in points if finite(p.x) and finite(p.y)]
    if not shown:
        return _empty(title, "no trials with both measures")
    xs, ys = [_clamp(p.x) for p in shown], [_clamp(p.y) for p in shown]
    x, y = _x_axis(min(xs), max(xs)), _y_axis(min(ys), max(ys))
    body = _axes(x, y, x_label, y_label)
    front = sorted((p for p in shown if p.on_front), key=lambda p: (p.x, p.y))
    if len(front) > 1:
        line = _points((x(_clamp(p.x)), y(_clamp(p.y))) for p in front)
        body.append(f'<polyline class="front" points="{line}" fill="none" stroke="{BASELINE}" '
                    f'stroke-width="2"/>')
    for point in sorted(shown, key=lambda p: p.on_front):  # the front on top
        body.append(_scatter_marker(point, x, y, x_label, y_label))
    entries = [("front", "Pareto front")] if front else []
    if len(front) < len(shown):
        entries.append(("other", "other trials"))
    return _svg(title, body + _legend(entries))


def _scatter_marker(point: ScatterPoint, x: _Axis, y: _Axis, x_label: str, y_label: str) -> str:
    where = f"{x_label} {point.x:.4g}, {y_label} {point.y:.4g}"
    tip = f"{point.label}: {where}" if point.label is not None else where
    cx, cy = x(_clamp(point.x)), y(_clamp(point.y))
    if point.on_front:
        return _dot(cx, cy, 5, BASELINE, AXIS, tip)
    return _dot(cx, cy, 3.5, INFEASIBLE, INFEASIBLE, tip)


# horizontal bars --------------------------------------------------------------------------------

BAR_ROW, BAR_TOP, BAR_BOTTOM, VALUE_ROOM = 26, 12, 48, 64


def bar_chart(bars: Sequence[tuple[str, float]], value_label: str, title: str = "") -> str:
    """One horizontal bar per (name, value) from 0, its value written at its end."""
    title = title or value_label
    if not bars:
        return _empty(title, "nothing to show")
    label_chars = min(36, max(len(name) for name, _ in bars))
    values = [_clamp(v) for _, v in bars if finite(v)] + [0.0]
    x = _x_axis(min(values), max(values), left=CHAR_W * label_chars + 20,
                right=WIDTH - VALUE_ROOM)
    height = BAR_TOP + BAR_ROW * len(bars) + BAR_BOTTOM
    y = _Axis(0.0, 1.0, (), height - BAR_BOTTOM, BAR_TOP)  # only its pixel range is used
    body = _axes(x, y, value_label, "")
    for row, (name, value) in enumerate(bars):
        body.append(_bar(x, BAR_TOP + row * BAR_ROW, name, value, label_chars))
    return _svg(title, body, height=height)


def _bar(x: _Axis, top: float, name: str, value: float, label_chars: int) -> str:
    mid, shown = top + BAR_ROW / 2, _truncate(name, label_chars)
    exact = f"{value:.4g}" if finite(value) else "n/a"
    parts = [_tooltip(f"{name}: {exact}"), _text(x.start - 8, mid + 4, shown, anchor="end")]
    if not finite(value):
        return "<g>" + "".join(parts + [_text(x(0) + 4, mid + 4, "n/a", "start", MUTED)]) + "</g>"
    zero, end = x(0), x(_clamp(value))
    left, width = min(zero, end), abs(end - zero)
    parts.append(f'<rect x="{_f(left)}" y="{_f(top + 4)}" width="{_f(width)}" '
                 f'height="{_f(BAR_ROW - 8)}" fill="{FEASIBLE}" rx="2"/>')
    parts.append(_text(max(zero, end) + 4, mid + 4, si(value), anchor="start"))
    return "<g>" + "".join(parts) + "</g>"


def _truncate(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


# the page ---------------------------------------------------------------------------------------

CSS = """
:root { color-scheme: light; }
body { margin: 0; background: #fff; color: #111827;
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 20px 64px; }
h1 { font-size: 1.6em; margin: 0 0 8px; }
h2 { font-size: 1.25em; margin: 36px 0 12px; padding-bottom: 4px; border-bottom: 1px solid #e5e7eb; }
nav ul { margin: 0; padding: 0; list-style: none; display: flex; flex-wrap: wrap; gap: 4px 16px; }
a { color: #2563eb; }
svg.plot { display: block; max-width: 100%; height: auto; margin: 8px 0; }
.table-wrap { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.9em; margin: 8px 0; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e5e7eb; text-align: left; white-space: nowrap; }
th { background: #f3f4f6; font-weight: 600; position: sticky; top: 0; }
tbody tr:nth-child(even) { background: #f9fafb; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.9em; }
"""

_NUMBER = re.compile(r"[-+]?(\d[\d,_]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*[%a-zA-Z/]{0,8}")


def html_page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A complete HTML5 page: the title, links to the sections, then each section's heading and
    its body, which is trusted HTML (the output of the functions here)."""
    nav = "".join(f'<li><a href="#section-{i}">{_e(heading)}</a></li>'
                  for i, (heading, _) in enumerate(sections))
    body = "".join(f'<section id="section-{i}">\n<h2>{_e(heading)}</h2>\n{content}\n</section>\n'
                   for i, (heading, content) in enumerate(sections))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
            f"<h1>{_e(title)}</h1>\n<nav><ul>{nav}</ul></nav>\n{body}</main>\n</body>\n</html>\n")


def table_html(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table of text cells; numeric-looking cells ('9.18', '120 ms') are right-aligned."""
    head = "".join(f"<th>{_e(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(_cell(cell) for cell in row) + "</tr>\n" for row in rows)
    return (f'<div class="table-wrap"><table>\n<thead><tr>{head}</tr></thead>\n'
            f"<tbody>\n{body}</tbody>\n</table></div>")


def _cell(cell: str) -> str:
    numeric = _NUMBER.fullmatch(cell.strip()) is not None
    return f'<td class="num">{_e(cell)}</td>' if numeric else f"<td>{_e(cell)}</td>"


def list_html(items: Iterable[str]) -> str:
    return "<ul>\n" + "".join(f"<li>{_e(item)}</li>\n" for item in items) + "</ul>"
