"""The report's chart, drawn with Pillow (no plotting library is a dependency).

Three panels side by side, each measured figure next to its reference:

1. latency vs concurrent sessions: pipeline p50/p99 and the raw round trip
   p50/p99 (log scale: a saturated point is orders of magnitude above);
2. throughput vs worker processes: pipeline events/s as bars, the raw Python
   unbatched and batched limits as lines;
3. the scaling curve: sessions served within the latency budget vs worker
   processes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 1500, 560
PANEL_W = WIDTH // 3
MARGIN = {"left": 72, "right": 20, "top": 56, "bottom": 92}
INK = (33, 37, 41)
GRID = (222, 226, 230)
BLUE = (31, 119, 180)
ORANGE = (255, 127, 14)
GREY = (120, 120, 120)
GREEN = (44, 160, 44)
RED = (214, 39, 40)


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


class Panel:
    """One plot area: maps data to pixels and draws axes, series and a legend."""

    def __init__(self, draw: ImageDraw.ImageDraw, index: int, title: str, xlabel: str,
                 ylabel: str) -> None:  # fmt: skip
        self.draw = draw
        x0 = index * PANEL_W
        self.left, self.right = x0 + MARGIN["left"], x0 + PANEL_W - MARGIN["right"]
        self.top, self.bottom = MARGIN["top"], HEIGHT - MARGIN["bottom"]
        self.font, self.small = _font(15), _font(12)
        draw.text((x0 + PANEL_W // 2, 18), title, fill=INK, font=_font(17), anchor="mt")
        draw.text(((self.left + self.right) // 2, HEIGHT - 50), xlabel, fill=INK,
                  font=self.font, anchor="mt")  # fmt: skip
        draw.text((x0 + 8, self.top - 24), ylabel, fill=INK, font=self.small)
        self.legend: list[tuple[str, tuple[int, int, int], str]] = []
        self.xs: list[str] = []
        self.log = False
        self.ymin, self.ymax = 0.0, 1.0

    def set_x(self, labels: Sequence[str]) -> None:
        self.xs = list(labels)

    def x(self, i: float) -> float:
        step = (self.right - self.left) / max(1, len(self.xs))
        return self.left + step * (i + 0.5)

    def set_y(self, values: Sequence[float], *, log: bool = False) -> None:
        finite = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
        self.log = log
        if not finite:
            self.ymin, self.ymax = (0.1, 10.0) if log else (0.0, 1.0)
        elif log:
            self.ymin = 10 ** math.floor(math.log10(min(finite)))
            self.ymax = 10 ** math.ceil(math.log10(max(finite)))
            if self.ymax <= self.ymin:
                self.ymax = self.ymin * 10
        else:
            self.ymin, self.ymax = 0.0, _nice_ceiling(max(finite) * 1.1)

    def y(self, value: float) -> float:
        if self.log:
            value = max(value, self.ymin)
            span = math.log10(self.ymax) - math.log10(self.ymin)
            frac = (math.log10(value) - math.log10(self.ymin)) / span
        else:
            frac = (value - self.ymin) / (self.ymax - self.ymin)
        return self.bottom - frac * (self.bottom - self.top)

    def axes(self) -> None:
        d = self.draw
        for tick in self._yticks():
            py = self.y(tick)
            d.line([(self.left, py), (self.right, py)], fill=GRID)
            d.text((self.left - 6, py), _fmt(tick), fill=INK, font=self.small, anchor="rm")
        d.line([(self.left, self.top), (self.left, self.bottom), (self.right, self.bottom)],
               fill=INK, width=1)  # fmt: skip
        for i, label in enumerate(self.xs):
            d.text((self.x(i), self.bottom + 8), label, fill=INK, font=self.font, anchor="mt")

    def _yticks(self) -> list[float]:
        if self.log:
            ticks, value = [], self.ymin
            while value <= self.ymax * 1.0001:
                ticks.append(value)
                value *= 10
            return ticks
        return [self.ymax * k / 5 for k in range(6)]

    def line(self, values: Sequence[float | None], color: tuple[int, int, int], label: str,
             *, dashed: bool = False, hollow: Sequence[bool] = ()) -> None:  # fmt: skip
        """A series; points flagged in ``hollow`` are drawn as open circles."""
        points = [(self.x(i), self.y(v), i < len(hollow) and hollow[i])
                  for i, v in enumerate(values) if v is not None and math.isfinite(v)]  # fmt: skip
        xy = [(px, py) for px, py, _ in points]
        if dashed:
            for a, b in itertools.pairwise(xy):
                _dashed(self.draw, a, b, color)
        elif len(xy) > 1:
            self.draw.line(xy, fill=color, width=3)
        for px, py, open_ in points:
            box = [px - 5, py - 5, px + 5, py + 5]
            if open_:
                self.draw.ellipse(box, fill="white", outline=color, width=2)
            else:
                self.draw.ellipse(box, fill=color)
        self.legend.append((label, color, "dash" if dashed else "line"))

    def hline(self, value: float, color: tuple[int, int, int], label: str) -> None:
        if math.isfinite(value):
            _dashed(self.draw, (self.left, self.y(value)), (self.right, self.y(value)), color)
            self.legend.append((label, color, "dash"))

    def bars(self, values: Sequence[float], color: tuple[int, int, int], label: str) -> None:
        half = (self.right - self.left) / max(1, len(self.xs)) * 0.28
        for i, v in enumerate(values):
            if math.isfinite(v):
                self.draw.rectangle([self.x(i) - half, self.y(v), self.x(i) + half, self.bottom],
                                    fill=color)  # fmt: skip
                text = _fmt(round(v))
                self.draw.text((self.x(i), self.y(v) - 4), text, fill=INK, font=self.small,
                               anchor="mb")  # fmt: skip
        self.legend.append((label, color, "box"))

    def draw_legend(self) -> None:
        y = HEIGHT - 30
        x = self.left - 50
        for label, color, style in self.legend:
            if style == "box":
                self.draw.rectangle([x, y - 5, x + 16, y + 5], fill=color)
            elif style == "dash":
                _dashed(self.draw, (x, y), (x + 16, y), color)
            else:
                self.draw.line([(x, y), (x + 16, y)], fill=color, width=3)
            self.draw.text((x + 20, y), label, fill=INK, font=self.small, anchor="lm")
            x += 28 + int(self.draw.textlength(label, font=self.small))
            if x > self.right - 40:
                x, y = self.left - 50, y + 16


def _dashed(draw: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float],
            color: tuple[int, int, int], dash: float = 7) -> None:  # fmt: skip
    length = math.dist(a, b)
    steps = max(1, int(length // dash))
    for k in range(0, steps, 2):
        t0, t1 = k / steps, min(1.0, (k + 1) / steps)
        draw.line([(a[0] + (b[0] - a[0]) * t0, a[1] + (b[1] - a[1]) * t0),
                   (a[0] + (b[0] - a[0]) * t1, a[1] + (b[1] - a[1]) * t1)],
                  fill=color, width=2)  # fmt: skip


def _nice_ceiling(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(value))
    for m in (1, 2, 2.5, 5, 10):
        if value <= m * exp:
            return m * exp
    return 10 * exp


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}k"
    if value >= 1 or value == 0:
        return f"{value:g}"
    return f"{value:.2g}"


def _latency_panel(draw: ImageDraw.ImageDraw, results: dict[str, Any]) -> None:
    panel = Panel(draw, 0, "Latency vs concurrent sessions",
                  "sessions, 25 chunks/s each (open: not served)", "ms (log)")  # fmt: skip
    section = results.get("latency", {})
    points = [p for p in section.get("points", []) if "error" not in p]
    fallback = section.get("reference_round_trip", {})
    refs = [p.get("reference_round_trip", fallback) for p in points]
    panel.set_x([str(p["sessions"]) for p in points])
    p50 = [p["latency"]["p50_ms"] for p in points]
    p99 = [p["latency"]["p99_ms"] for p in points]
    raw50 = [r.get("p50_ms", math.nan) for r in refs]
    raw99 = [r.get("p99_ms", math.nan) for r in refs]
    panel.set_y([*p50, *p99, *raw50, *raw99], log=True)
    panel.axes()
    unserved = [not p.get("served", True) for p in points]
    panel.line(p50, BLUE, "pipeline p50", hollow=unserved)
    panel.line(p99, ORANGE, "pipeline p99", hollow=unserved)
    panel.line(raw50, BLUE, "raw RTT p50", dashed=True)
    panel.line(raw99, ORANGE, "raw RTT p99", dashed=True)
    panel.draw_legend()


def _throughput_panel(draw: ImageDraw.ImageDraw, results: dict[str, Any]) -> None:
    panel = Panel(draw, 1, "Throughput to saturation", "echo worker processes", "events/s")
    tp = results.get("throughput", {})
    points = tp.get("points", [])
    panel.set_x([str(p["workers"]) for p in points])
    values = [p["events_per_s"] for p in points]
    unbatched = tp.get("reference_unbatched_eps", math.nan)
    batched = tp.get("reference_batched_eps", math.nan)
    panel.set_y([*values, unbatched, batched])
    panel.axes()
    panel.bars(values, BLUE, "pipeline")
    panel.hline(unbatched, GREY, "raw unbatched")
    panel.hline(batched, GREEN, "raw batched")
    panel.draw_legend()


def _scaling_panel(draw: ImageDraw.ImageDraw, results: dict[str, Any]) -> None:
    scaling = results.get("scaling", {})
    budget = scaling.get("budget_ms", 20)
    panel = Panel(draw, 2, f"Sessions within p99 +{budget:g} ms", "echo worker processes",
                  "sessions")  # fmt: skip
    curve = scaling.get("curve", [])
    panel.set_x([str(row["workers"]) for row in curve])
    values = [float(row["sessions_within_budget"]) for row in curve]
    panel.set_y(values)
    panel.axes()
    panel.line(values, GREEN, "sessions served")
    if curve:
        ideal = [values[0] * row["workers"] / curve[0]["workers"] for row in curve]
        panel.line([v if v <= panel.ymax else None for v in ideal], RED, "linear", dashed=True)
    panel.draw_legend()


def render(results: dict[str, Any], path: Path) -> None:
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    _latency_panel(draw, results)
    _throughput_panel(draw, results)
    _scaling_panel(draw, results)
    image.save(path, optimize=True)
