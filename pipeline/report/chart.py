"""SVG building blocks of the report: scales, axes whose ticks carry units, colours.

Everything is inline SVG with whole-pixel coordinates, so lines and areas are
drawn crisp (and a screenshot can be checked pixel by pixel).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

from pipeline.memory.units import GIB, KIB, MIB, TIB

VERDICT_COLORS = {
    "succeeded": "#1a7f37",
    "completed_then_crashed": "#9a6700",
    "timed_out": "#8250df",
    "cancelled": "#9a6700",
}
FAILED_COLOR = "#cf222e"  # every other verdict
RUNNING_COLOR = "#0969da"
# One colour per step, none of them a verdict's or a series' below.
STEP_PALETTE = ["#4e79a7", "#f28e2b", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#59a1d6"]
OTHER_COLOR = "#c8cdd3"  # memory in use outside the run's steps
AVAILABLE_COLOR = "#2da44e"  # MemAvailable
CGROUP_AVAILABLE_COLOR = "#116329"  # what the cgroups eyrie runs in leave
BUDGET_COLOR = "#0a3069"
OOM_COLOR = "#e00000"
CRASH_COLOR = "#a4238b"
TEXT_COLOR = "#57606a"
GRID_COLOR = "#eaeef2"


def verdict_color(verdict: str | None) -> str:
    return VERDICT_COLORS.get(verdict or "", FAILED_COLOR if verdict else RUNNING_COLOR)


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


# -- ticks -------------------------------------------------------------------------------------
_UNITS = {"TiB": TIB, "GiB": GIB, "MiB": MIB, "KiB": KIB, "B": 1}
_MANTISSAS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 500, 512)
# Steps below one unit: they keep an axis that reaches 1.5 GiB in GiB (0.5 GiB apart), not 500 MiB.
_FRACTIONS = (0.25, 0.5)
_TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]


def byte_ticks(top: float, most: int = 5) -> list[int]:
    """Round byte values from 0 to at least ``top``, at most ``most`` steps apart, each round in one
    unit: the largest unit the highest tick fills, which labels the whole axis."""
    top = max(top, 1)
    for unit in _UNITS.values():
        steps = [m * unit for m in (*(_FRACTIONS if unit > 1 else ()), *_MANTISSAS)]
        step = next((s for s in steps if top / s <= most), steps[-1] * math.ceil(top / steps[-1] / most))
        ticks = [round(i * step) for i in range(math.ceil(top / step - 1e-9) + 1)]
        if ticks[-1] >= unit:
            return ticks
    raise AssertionError("unreachable: the last unit is a byte")


def size_unit(value: float) -> str:
    """The largest unit ``value`` fills: ``GiB`` for 1.5 GiB, ``MiB`` for 1000 MiB."""
    return next((name for name, unit in _UNITS.items() if value >= unit), "B")


def byte_label(value: float, unit: str | None = None) -> str:
    """``0``, ``512 MiB``, ``1.5 GiB``: in ``unit`` (one axis's), else the largest unit the value fills."""
    if value == 0:
        return "0"
    unit = unit or size_unit(value)
    return f"{value / _UNITS[unit]:.2f}".rstrip("0").removesuffix(".") + f" {unit}"


def time_ticks(span: float, most: int = 8) -> list[float]:
    """Round elapsed times from 0 to ``span`` (seconds)."""
    step = next((s for s in _TIME_STEPS if span / s <= most), 86400 * math.ceil(span / 86400 / most))
    return [i * step for i in range(int(span // step) + 1)]


def time_label(seconds: float, span: float) -> str:
    """``0:45`` (m:ss) within an hour, ``1:30`` (h:mm) beyond; ``time_unit`` names which."""
    seconds = round(seconds)
    if span < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}"


def time_unit(span: float) -> str:
    return "m:ss" if span < 3600 else "h:mm"


# -- scales and axes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    """A linear map from values to whole pixels."""

    lo: float
    hi: float
    out_lo: int
    out_hi: int

    def __call__(self, value: float) -> int:
        span = self.hi - self.lo or 1
        return round(self.out_lo + (self.out_hi - self.out_lo) * (value - self.lo) / span)


def y_axis(y: Scale, ticks: list[int], x0: int, x1: int) -> str:
    """Grid lines across [x0, x1] and a size label left of x0 at each tick, all in one unit."""
    unit = size_unit(ticks[-1])
    parts = []
    for tick in ticks:
        py = y(tick)
        parts.append(
            f'<line x1="{x0}" x2="{x1}" y1="{py}.5" y2="{py}.5" stroke="{GRID_COLOR}"/>'
            f'<text x="{x0 - 6}" y="{py + 4}" text-anchor="end">{esc(byte_label(tick, unit))}</text>'
        )
    return "".join(parts)


def x_axis(x: Scale, span: float, y0: int, y1: int, *, labels_at: int | None) -> str:
    """Grid lines from y0 to y1 at round elapsed times; labels under ``labels_at`` when given."""
    parts = []
    for tick in time_ticks(span):
        px = x(tick)
        parts.append(f'<line x1="{px}.5" x2="{px}.5" y1="{y0}" y2="{y1}" stroke="{GRID_COLOR}"/>')
        if labels_at is not None:
            parts.append(
                f'<text x="{px}" y="{labels_at}" text-anchor="middle">{time_label(tick, span)}</text>'
            )
    return "".join(parts)


def step_path(xs: list[int], ys: list[int]) -> str:
    """A step line through columns: value ``ys[i]`` from ``xs[i]`` to ``xs[i + 1]``."""
    out = [f"M{xs[0]},{ys[0]}"]
    for i, value in enumerate(ys):
        if i:
            out.append(f"V{value}")
        out.append(f"H{xs[i + 1]}")
    return "".join(out)


def band_path(xs: list[int], lower: list[int], upper: list[int]) -> str:
    """A closed area between two step lines over the same columns."""
    top = step_path(xs, upper)
    back = [f"V{lower[-1]}"]
    for i in range(len(lower) - 1, -1, -1):
        back.append(f"H{xs[i]}")
        if i:
            back.append(f"V{lower[i - 1]}")
    return top + "".join(back) + "Z"
