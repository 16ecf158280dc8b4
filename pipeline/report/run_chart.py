"""The run chart: the whole machine over a run's wall-clock time, one SVG.

Three panels share the time axis:

- host: memory in use (each step's anonymous memory in its colour, the rest of
  the host grey), MemAvailable, and the run's budget; left out, saying why,
  when the steps ran on machines the runner could not see (Slurm's nodes);
- steps: each attempt a band as high as what it held of the budget — its
  limit, or a compile job's reservation as it changed — filled by what its
  cgroup was charged, stacked in start order, so the stack's top is what the
  running steps held against the budget at that moment;
- attempts: a Gantt bar per attempt coloured by verdict, its fill the attempt's
  memory against its limit.

Every OOM kill and crash is a vertical line at its moment, across all three.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pipeline.memory import format_duration, format_size
from pipeline.report.chart import (
    AVAILABLE_COLOR,
    BUDGET_COLOR,
    CGROUP_AVAILABLE_COLOR,
    CRASH_COLOR,
    OOM_COLOR,
    OTHER_COLOR,
    STEP_PALETTE,
    TEXT_COLOR,
    Scale,
    band_path,
    byte_label,
    byte_ticks,
    esc,
    step_path,
    time_unit,
    verdict_color,
    x_axis,
    y_axis,
)
from pipeline.report.timeline import RunTimeline, Track, clock

WIDTH, LEFT, RIGHT = 1000, 190, 24
HOST_H, STEPS_H, TITLE_H, LANE_H = 200, 160, 30, 14
LABEL_CHARS = 28  # what fits left of the plot
COLUMN_S = 0.25  # finest column: the host is polled four times a second
MAX_NAMED = 12  # steps named in the legend; more (a build's compile jobs) are named on their rows only
BUDGET_UNDER_W = 6  # the host panel's budget line: 2 px of it show each side of a 2 px line on it
CGROUP_GAP = 0.05  # draw the cgroups' figure only where it sits this far (of the total) below MemAvailable


@dataclass(frozen=True)
class Legend:
    color: str
    label: str
    kind: str  # area | line | dashed | band | mark


def step_colors(timeline: RunTimeline) -> dict[str, str]:
    colors: dict[str, str] = {}
    for track in timeline.tracks:
        colors.setdefault(track.row.step, STEP_PALETTE[len(colors) % len(STEP_PALETTE)])
    return colors


def run_chart(timeline: RunTimeline) -> tuple[str, list[Legend]]:
    """The SVG of one run, and its legend (drawn by the page, where text never overlaps a line)."""
    span = max(timeline.end - timeline.start, 1.0)
    plot_w = WIDTH - LEFT - RIGHT
    n = max(1, min(plot_w, math.ceil(span / COLUMN_S)))
    edges = [timeline.start + span * i / n for i in range(n + 1)]
    x = Scale(0, span, LEFT, WIDTH - RIGHT)
    xs = [x(t - timeline.start) for t in edges]
    colors = step_colors(timeline)
    tracks = sorted(timeline.tracks, key=lambda t: (t.start, t.row.id))
    events = sorted(((t, *t.event) for t in tracks if t.event), key=lambda e: e[1])
    lanes = min(len(events), 4)

    # The host panel's title, then a lane per event label, then the panels: no line crosses a title.
    lane_top = 22
    host_h = 0 if timeline.steps_elsewhere else HOST_H  # then only its title, saying why
    host_box = (lane_top + LANE_H * lanes + 6, lane_top + LANE_H * lanes + 6 + host_h)
    steps_box = (host_box[1] + TITLE_H, host_box[1] + TITLE_H + STEPS_H)
    row_h = 16 if len(tracks) <= 40 else max(6, 640 // len(tracks))
    gantt_box = (steps_box[1] + TITLE_H, steps_box[1] + TITLE_H + row_h * max(len(tracks), 1))
    height = gantt_box[1] + 40

    if len(colors) <= MAX_NAMED:
        legend: list[Legend] = [Legend(colors[s], s, "area") for s in colors]
    else:  # a build's hundreds of compile jobs: their names are on the Gantt rows
        legend = [
            Legend(STEP_PALETTE[0], f"{len(colors)} jobs, coloured in turn (named on their rows)", "area")
        ]
    body: list[str] = [
        x_axis(x, span, box[0], box[1], labels_at=gantt_box[1] + 16 if box == gantt_box else None)
        for box in (host_box, steps_box, gantt_box)
        if box[1] > box[0]
    ]
    if timeline.steps_elsewhere:
        executor = timeline.run["executor"]
        body.append(
            _title(
                f"Host memory: not sampled — the steps ran on the cluster's nodes ({executor} executor), "
                "which the runner cannot see",
                14,
            )
        )
    else:
        body += _host_panel(timeline, tracks, edges, xs, host_box, colors, legend)
    body += _steps_panel(timeline, tracks, edges, xs, steps_box, colors, legend)
    body += _gantt(tracks, x, timeline.start, gantt_box, row_h)
    for i, (track, moment, what) in enumerate(events):
        color = OOM_COLOR if what == "OOM kill" else CRASH_COLOR
        px = x(moment - timeline.start)
        label_y = lane_top + LANE_H * (i % lanes) + 10
        anchor, shift = ("end", -4) if px > WIDTH - RIGHT - 200 else ("start", 4)
        segments = [(label_y - 9, host_box[1]), steps_box, gantt_box]
        lines = "".join(
            f'<line x1="{px}" x2="{px}" y1="{y0}" y2="{y1}" stroke="{color}" stroke-width="2"/>'
            for y0, y1 in segments
        )
        body.append(
            f'<g class="event" data-what="{esc(what)}" data-step="{esc(track.row.step)}">{lines}'
            f'<text x="{px + shift}" y="{label_y}" text-anchor="{anchor}" style="fill:{color}">'
            f"{esc(what)}: {esc(track.row.step)} at {clock(moment)}</text></g>"
        )
    if any(what == "OOM kill" for _, _, what in events):
        legend.append(Legend(OOM_COLOR, "OOM kill", "mark"))
    if any(what != "OOM kill" for _, _, what in events):
        legend.append(Legend(CRASH_COLOR, "crash or memory error", "mark"))
    body.append(
        f'<text x="{WIDTH - RIGHT}" y="{gantt_box[1] + 32}" text-anchor="end">'
        f"elapsed ({time_unit(span)}) since {clock(timeline.start)}, {format_duration(span)} in all</text>"
    )
    svg = (
        f'<svg class="run-chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'role="img" aria-label="memory of run {esc(timeline.run["run_id"])}">{"".join(body)}</svg>'
    )
    return svg, legend


def _host_panel(
    timeline: RunTimeline,
    tracks: list[Track],
    edges: list[float],
    xs: list[int],
    box: tuple[int, int],
    colors: dict[str, str],
    legend: list[Legend],
) -> list[str]:
    cols = range(len(edges) - 1)
    hosts = [timeline.host_between(edges[i], edges[i + 1]) for i in cols]
    anons = {t.row.id: [t.usage_between(edges[i], edges[i + 1], anon=True) for i in cols] for t in tracks}
    stacked = [sum(anons[t.row.id][i] or 0 for t in tracks) for i in cols]
    budget = timeline.run["budget_bytes"]
    if timeline.host:
        top = max(s.mem_total for s in timeline.host)
        title = (
            "Host memory: in use (each step's anonymous memory in its colour, the rest grey), MemAvailable"
        )
    else:
        top = max([*stacked, budget or 0, 1])
        title = "Steps' anonymous memory (this ledger has no samples of the host: it predates them)"
    y = Scale(0, byte_ticks(top)[-1], box[1], box[0])
    parts = [_title(title, 14), y_axis(y, byte_ticks(top), LEFT, WIDTH - RIGHT)]
    base = [0] * len(stacked)
    for track in tracks:
        values = anons[track.row.id]
        upper = [base[i] + (values[i] or 0) for i in cols]
        parts.append(_area(xs, base, upper, y, colors[track.row.step], f"host-{track.row.step}"))
        base = upper
    if timeline.host:
        in_use = [max(h.in_use, base[i]) if h else base[i] for i, h in enumerate(hosts)]
        parts.append(_area(xs, base, in_use, y, OTHER_COLOR, "host-other"))
        legend.append(Legend(OTHER_COLOR, "in use by the rest of the host", "area"))
    if budget:
        # Under the lines and wider than they are: a budget set by MemAvailable lies on its line,
        # which still shows along the budget's middle.
        parts.append(_budget(y, budget, width=BUDGET_UNDER_W))
    if timeline.host:
        available = [h.mem_available if h else 0 for h in hosts]
        parts.append(_line(xs, available, y, AVAILABLE_COLOR, "mem-available"))
        legend.append(Legend(AVAILABLE_COLOR, "MemAvailable", "line"))
        cgroups = [h.available if h else 0 for h in hosts]
        if any(h and h.mem_available - h.available > CGROUP_GAP * h.mem_total for h in hosts):
            parts.append(_line(xs, cgroups, y, CGROUP_AVAILABLE_COLOR, "cgroup-available", dashed=True))
            legend.append(Legend(CGROUP_AVAILABLE_COLOR, "what the cgroups eyrie runs in leave", "dashed"))
    return parts


def _steps_panel(
    timeline: RunTimeline,
    tracks: list[Track],
    edges: list[float],
    xs: list[int],
    box: tuple[int, int],
    colors: dict[str, str],
    legend: list[Legend],
) -> list[str]:
    cols = range(len(edges) - 1)
    # What each attempt held in each column, at one moment: the column's middle, as the budget is
    # kept at every moment (a column's highest of each would stack a job admitted late in it on the
    # share that made room for it). An attempt shorter than a column is drawn at its own middle.
    middles = [(edges[i] + edges[i + 1]) / 2 for i in cols]
    held = {}
    for t in tracks:
        moments: list[float | None] = [m if t.start <= m <= t.end else None for m in middles]
        if all(m is None for m in moments):
            own = (t.start + t.end) / 2
            moments[min(bisect.bisect_right(edges, own), len(middles)) - 1] = own
        held[t.row.id] = [None if m is None else t.held_at(m) for m in moments]
    usage = {
        t.row.id: [
            t.usage_between(edges[i], edges[i + 1]) if held[t.row.id][i] is not None else None for i in cols
        ]
        for t in tracks
    }
    reserved = [sum(held[t.row.id][i] or 0 for t in tracks) for i in cols]
    budget = timeline.run["budget_bytes"]
    top = max([*reserved, 1])
    budget_shown = bool(budget) and budget <= 1.5 * top
    if budget_shown:
        top = max(top, budget)
    ticks = byte_ticks(top)
    y = Scale(0, ticks[-1], box[1], box[0])
    title = "Steps: each band is what an attempt held, filled by the memory its cgroup was charged"
    if budget and not budget_shown:
        title += f" (budget {byte_label(budget)}, far above)"
    parts = [_title(title, box[0] - 9), y_axis(y, ticks, LEFT, WIDTH - RIGHT)]
    base = [0] * len(reserved)
    for track in tracks:
        values, heights = usage[track.row.id], held[track.row.id]
        if all(h is None for h in heights):
            continue
        upper = [base[i] + (heights[i] or 0) for i in cols]
        filled = [base[i] + min(values[i] or 0, heights[i] or 0) for i in cols]
        color = colors[track.row.step]
        outline = band_path(xs, _px(base, y), _px(upper, y))
        parts.append(
            f'<path class="band" data-step="{esc(track.row.step)}" d="{outline}" fill="{color}" '
            f'fill-opacity="0.18" stroke="{color}"/>'
        )
        parts.append(_area(xs, base, filled, y, color, f"steps-{track.row.step}"))
        parts.append(_band_label(track, xs, base, upper, y))
        base = upper
    legend.append(Legend(TEXT_COLOR, "what an attempt held of the budget (its limit or reservation)", "band"))
    if budget_shown:
        parts.append(_budget(y, budget))
    if budget:
        legend.append(Legend(BUDGET_COLOR, f"the run's budget, {byte_label(budget)}", "dashed"))
    return parts


def _gantt(tracks: list[Track], x: Scale, start: float, box: tuple[int, int], row_h: int) -> list[str]:
    title = "Attempts, coloured by verdict: each bar's height is its limit, its fill the memory in use"
    parts = [_title(title, box[0] - 9)]
    for i, track in enumerate(tracks):
        row, top = track.row, box[0] + i * row_h
        color = verdict_color(row.verdict)
        x0, x1 = x(track.start - start), x(track.end - start)
        x1 = max(x1, x0 + 2)
        bar_h = row_h - 3
        name = _label(row.step, row.attempt)
        peak = f"{format_size(row.peak_bytes)} / {format_size(row.limit_bytes)}"
        parts.append(
            f'<g class="attempt" data-step="{esc(row.step)}" data-verdict="{esc(row.verdict or "running")}">'
            f"<title>{esc(name)}: {esc(row.verdict or 'running')}, peak {esc(peak)}</title>"
        )
        if row_h >= 8:
            # A compile job's file name differs from its neighbours' towards its end.
            label = name if len(name) <= LABEL_CHARS else "…" + name[-(LABEL_CHARS - 1) :]
            size = min(11, row_h - 1)
            parts.append(
                f'<text x="{LEFT - 6}" y="{top + bar_h - 1}" text-anchor="end" style="font-size:{size}px">'
                f"{esc(label)}</text>"
            )
        parts.append(  # half-pixel offsets: a one-pixel outline falls on whole pixels, crisp
            f'<rect x="{x0}.5" y="{top}.5" width="{x1 - x0 - 1}" height="{bar_h - 1}" fill="{color}" '
            f'fill-opacity="0.2" stroke="{color}"/>'
        )
        bottom, fill = top + bar_h, []
        for px in range(x0, x1):
            used = track.usage_between(*_times(x, start, px))
            if used and row.limit_bytes:
                height = round(bar_h * min(used, row.limit_bytes) / row.limit_bytes)
                fill.append(f"M{px},{bottom}V{bottom - height}H{px + 1}V{bottom}Z")
        if fill:
            parts.append(f'<path d="{"".join(fill)}" fill="{color}"/>')
        if row_h >= 10:
            text = f"{row.verdict or 'running'}, peak {peak}"
            if x1 + 8 + 7 * len(text) <= WIDTH:
                parts.append(f'<text x="{x1 + 4}" y="{top + bar_h - 2}">{esc(text)}</text>')
        parts.append("</g>")
    return parts


def _times(x: Scale, start: float, px: int) -> tuple[float, float]:
    """The times a one-pixel column of the plot covers."""
    per_px = (x.hi - x.lo) / (x.out_hi - x.out_lo)
    t0 = start + (px - x.out_lo) * per_px
    return t0, t0 + per_px


def _px(values: list[int], y: Scale) -> list[int]:
    return [y(v) for v in values]


def _area(xs: list[int], lower: list[int], upper: list[int], y: Scale, color: str, name: str) -> str:
    if all(u <= lo for lo, u in zip(lower, upper, strict=True)):
        return ""
    outline = band_path(xs, _px(lower, y), _px(upper, y))
    return f'<path class="area" data-series="{esc(name)}" d="{outline}" fill="{color}"/>'


def _line(xs: list[int], values: list[int], y: Scale, color: str, name: str, *, dashed: bool = False) -> str:
    dash = ' stroke-dasharray="6 3"' if dashed else ""
    return (
        f'<path class="line" data-series="{esc(name)}" d="{step_path(xs, _px(values, y))}" fill="none" '
        f'stroke="{color}" stroke-width="2"{dash}/>'
    )


def _budget(y: Scale, budget: int, width: int = 2) -> str:
    py = y(budget)
    return (
        f'<g class="budget"><line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py}" y2="{py}" '
        f'stroke="{BUDGET_COLOR}" stroke-width="{width}" stroke-dasharray="8 4"/>'
        f'<text x="{WIDTH - RIGHT - 4}" y="{py - 5}" text-anchor="end">'
        f"budget {esc(byte_label(budget))}</text></g>"
    )


def _band_label(track: Track, xs: list[int], base: list[int], upper: list[int], y: Scale) -> str:
    """The step's name inside its band, where the band is tallest, if it fits there."""
    heights = [y(lo) - y(hi) for lo, hi in zip(base, upper, strict=True)]
    best = max(range(len(heights)), key=lambda i: heights[i])
    if heights[best] < 13:
        return ""
    # The band's run of columns at that height, for the text's width.
    lo = hi = best
    while lo > 0 and heights[lo - 1] == heights[best] and base[lo - 1] == base[best]:
        lo -= 1
    while hi < len(heights) - 1 and heights[hi + 1] == heights[best] and base[hi + 1] == base[best]:
        hi += 1
    label = _label(track.row.step, track.row.attempt)
    if xs[hi + 1] - xs[lo] < 7 * len(label) + 6:
        return ""
    return (
        f'<text class="band-label" x="{xs[lo] + 4}" y="{y(upper[best]) + 12}" style="fill:#1f2328">'
        f"{esc(label)}</text>"
    )


def _label(step: str, attempt: int) -> str:
    return step if attempt == 1 else f"{step} #{attempt}"


def _title(text: str, baseline: int) -> str:
    return f'<text x="{LEFT}" y="{baseline}" style="fill:#1f2328;font-weight:600">{esc(text)}</text>'
