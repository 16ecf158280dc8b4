"""``eyrie report``: one self-contained HTML file — each run's chart, the attempts, their timelines.

No scripts, no external assets: it opens from disk, attaches to a ticket, and
prints. Each run gets the run chart (``run_chart``: the host, the steps against
their limits and the budget, a Gantt bar per attempt); each attempt its own
timeline — total memory (page cache included), anonymous memory, the limit,
the moment an OOM kill was counted — and its explanation.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import read_manifest
from pipeline.memory import format_duration, format_size
from pipeline.report.chart import (
    FAILED_COLOR,
    OOM_COLOR,
    RUNNING_COLOR,
    STEP_PALETTE,
    Scale,
    byte_label,
    byte_ticks,
    esc,
    step_path,
    time_unit,
    verdict_color,
    x_axis,
    y_axis,
)
from pipeline.report.explain import HEADLINE, attempt_account, not_run_reason
from pipeline.report.ledger_access import read_run
from pipeline.report.neighbours import neighbours
from pipeline.report.run_chart import Legend, run_chart
from pipeline.report.status import exit_text, not_run_steps
from pipeline.report.timeline import RunTimeline, clock, run_timeline
from pipeline.run.layout import REPORT_NAME
from pipeline.run.ledger import AttemptRow, Ledger

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #1f2328; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 4px 8px; border-bottom: 1px solid #d0d7de; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, .verdict, .why { text-align: left; }
.why { white-space: normal; width: 100%; }
.verdict { font-weight: 600; } .muted { color: #656d76; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; white-space: pre-wrap; }
svg text { font: 11px system-ui, sans-serif; fill: #57606a; }
ul.legend { list-style: none; padding: 0; margin: 4px 0 0; display: flex; flex-wrap: wrap; gap: 4px 16px; }
ul.legend li { display: flex; align-items: center; gap: 6px; font-size: 12px; color: #57606a; }
ul.legend i { display: inline-block; width: 18px; height: 10px; }
"""

# A legend swatch per kind of mark: areas filled, lines as a bar, dashed lines dashed, bands outlined.
_SWATCH = {
    "area": "background:{c}",
    "line": "height:3px;background:{c}",
    "dashed": "height:0;border-top:2px dashed {c}",
    "band": "border:1px solid {c};background:transparent",
    "mark": "width:3px;height:14px;background:{c}",
}
_ATTEMPT_W, _ATTEMPT_H, _ATTEMPT_LEFT, _ATTEMPT_RIGHT = 720, 180, 70, 16


def _legend(items: list[Legend]) -> str:
    entries = "".join(
        f"<li><i style='{_SWATCH[item.kind].format(c=item.color)}'></i>{esc(item.label)}</li>"
        for item in items
    )
    return f"<ul class='legend'>{entries}</ul>"


def timeline_svg(row: AttemptRow, points: list[tuple[float, int, int]]) -> str:
    """One attempt's memory over time: total and anonymous memory, its limit and its OOM kill."""
    if not points:
        return '<p class="muted">no timeline samples (the attempt ended within its first second)</p>'
    span = max(points[-1][0], row.wall_s or 0, 1e-3)
    ticks = byte_ticks(max(row.limit_bytes, max(p[1] for p in points), 1))
    top, bottom = 12, _ATTEMPT_H - 30
    x = Scale(0, span, _ATTEMPT_LEFT, _ATTEMPT_W - _ATTEMPT_RIGHT)
    y = Scale(0, ticks[-1], bottom, top)
    xs = [x(0.0), *(x(p[0]) for p in points)]
    # Each point is the highest of the window that ends at it: drawn as a step over that window.
    xs = [xs[0], *(max(a, b) for a, b in zip(xs[1:], xs[:-1], strict=True))]
    totals, anons = [y(p[1]) for p in points], [y(p[2]) for p in points]
    limit_y = y(row.limit_bytes)
    parts = [
        f'<svg viewBox="0 0 {_ATTEMPT_W} {_ATTEMPT_H}" width="{_ATTEMPT_W}" height="{_ATTEMPT_H}" role="img" '
        f'aria-label="memory of {esc(row.step)} attempt {row.attempt}">',
        y_axis(y, ticks, _ATTEMPT_LEFT, _ATTEMPT_W - _ATTEMPT_RIGHT),
        x_axis(x, span, top, bottom, labels_at=bottom + 14),
        f'<path d="{step_path(xs, totals)}" fill="none" stroke="{RUNNING_COLOR}" stroke-width="2"/>',
        f'<path d="{step_path(xs, anons)}" fill="none" stroke="{STEP_PALETTE[4]}" stroke-width="2" '
        'stroke-dasharray="3 2"/>',
        f'<line x1="{_ATTEMPT_LEFT}" x2="{_ATTEMPT_W - _ATTEMPT_RIGHT}" y1="{limit_y}" y2="{limit_y}" '
        f'stroke="{FAILED_COLOR}" stroke-width="2" stroke-dasharray="6 3"/>',
        f'<text x="{_ATTEMPT_LEFT + 4}" y="{limit_y - 4}" style="fill:{FAILED_COLOR}">'
        f"limit {esc(byte_label(row.limit_bytes))}</text>",
        f'<text x="{_ATTEMPT_W - _ATTEMPT_RIGHT}" y="{bottom + 28}" text-anchor="end">elapsed '
        f"({time_unit(span)}) since {clock(row.started_at)}</text>",
    ]
    legend = [
        Legend(RUNNING_COLOR, "memory charged to its cgroup (page cache included)", "line"),
        Legend(STEP_PALETTE[4], "anonymous memory", "dashed"),
        Legend(FAILED_COLOR, "its limit", "dashed"),
    ]
    if row.oom_at is not None:
        px = x(min(max(row.oom_at - row.started_at, 0.0), span))
        parts.append(
            f'<line x1="{px}" x2="{px}" y1="{top}" y2="{bottom}" stroke="{OOM_COLOR}" stroke-width="2"/>'
            f'<text x="{px + 4}" y="{top + 10}" style="fill:{OOM_COLOR}">OOM kill</text>'
        )
        legend.append(Legend(OOM_COLOR, "OOM kill counted", "mark"))
    parts.append("</svg>")
    return "".join(parts) + _legend(legend)


def _run_section(ledger: Ledger, timeline: RunTimeline) -> str:
    run = timeline.run
    head = (
        f"<h2 id='run-{esc(run['run_id'])}'>Run {esc(run['run_id'])}: "
        f"<span style='color:{verdict_color(None if run['state'] == 'running' else run['state'])}'>"
        f"{esc(run['state'])}</span></h2>"
        f"<p class='muted'>{esc(run['pipeline'])} · {esc(run['executor'])} executor on {esc(run['host'])} · "
        f"budget {esc(format_size(run['budget_bytes']))} (set by {esc(run['budget_binding'] or '-')})</p>"
    )
    not_run = _not_run_table(ledger, run)
    if not timeline.tracks:
        return head + "<p class='muted'>no attempts: no step of this run started</p>" + not_run
    svg, legend = run_chart(timeline)
    verdicts = sorted({t.row.verdict or "running" for t in timeline.tracks})
    legend += [Legend(verdict_color(v if v != "running" else None), v, "area") for v in verdicts]
    return head + svg + _legend(legend) + not_run


def _not_run_table(ledger: Ledger, run: dict) -> str:
    """The steps of a run that have no attempt in it (skipped, blocked, …), each with why."""
    rows = "".join(
        f"<tr class='not-run' data-step='{esc(step)}' data-state='{esc(state['state'])}'>"
        f"<td>{esc(step)}</td><td class='verdict muted'>{esc(state['state'])}</td>"
        f"<td class='why'>{esc(not_run_reason(state))}</td></tr>"
        for step, state in not_run_steps(ledger, run).items()
    )
    if not rows:
        return ""
    head = "<tr><th>step</th><th class='verdict'>state</th><th class='why'>why</th></tr>"
    return f"<h3>Steps that did not run</h3><table>{head}{rows}</table>"


# What a step that measured a draft (``eyrie accept``) keeps in its manifest's stats: the figures
# of each prompt set it measured (``sets``), and those pooled over all of them.
_ACCEPTANCE = [
    ("engine", "engine"),
    ("accept length", "accept_length"),
    ("output tok/s with the draft", "output_tokens_per_s"),
    ("output tok/s without", "baseline_output_tokens_per_s"),
    ("speed-up", "speedup"),
    ("prompts", "prompts"),
    ("steps / top-k / draft tokens", None),
]


def _acceptance_row(label: str, figures: dict, stats: dict) -> str:
    cells = []
    for _, key in _ACCEPTANCE:
        if key is None:
            value = f"{stats.get('num_steps')} / {stats.get('topk')} / {stats.get('num_draft_tokens')}"
        else:
            value = figures.get(key, stats.get(key))
        cells.append(f"<td>{esc('-' if value is None else str(value))}</td>")
    return f"<tr><td>{esc(label)}</td>{''.join(cells)}</tr>"


def acceptance_table(run_dir: Path, steps: list[str]) -> str:
    """The draft's accept length and tokens/s on each prompt set, for each step whose manifest
    records them (a manifest from before sets has its figures at the top only)."""
    rows = []
    for step in steps:
        manifest = read_manifest(run_dir / step)
        stats = manifest.stats if manifest else {}
        if "accept_length" not in stats:
            continue
        sets = stats.get("sets") or {}
        rows += [_acceptance_row(f"{step}: {name}", figures, stats) for name, figures in sets.items()]
        if len(sets) != 1:
            rows.append(_acceptance_row(f"{step}: all sets" if sets else step, stats, stats))
    if not rows:
        return ""
    head = "".join(f"<th>{esc(name)}</th>" for name, _ in _ACCEPTANCE)
    return (
        "<h2>The draft</h2><p>Accept length: tokens per verifying target forward, pooled over "
        f"requests.</p><table><tr><th>step: prompt set</th>{head}</tr>{''.join(rows)}</table>"
    )


def render(ledger: Ledger, run_dir: Path) -> str:
    attempts = ledger.attempts()
    latest = ledger.latest_run()
    title = f"eyrie run {latest['run_id']} — {latest['state']}" if latest else "eyrie ledger"
    rows = []
    for row in attempts:
        verdict = row.verdict or "running"
        rows.append(
            "<tr>"
            f"<td><a href='#{esc(row.step)}-{row.attempt}'>{esc(row.step)}</a></td>"
            f"<td>{row.attempt}</td>"
            f"<td class='verdict' style='color:{verdict_color(row.verdict)}'>{esc(verdict)}</td>"
            f"<td>{esc(exit_text(row))}</td>"
            f"<td>{format_size(row.peak_bytes)} / {format_size(row.limit_bytes)}</td>"
            f"<td>{'-' if row.oom_kills is None else row.oom_kills}</td>"
            f"<td>{format_duration(row.wall_s)}</td>"
            f"<td>{'-' if row.records is None else f'{row.records:,}'}</td>"
            "</tr>"
        )
    # Each run's timeline once: the run chart and every failed attempt's neighbours read it.
    timelines = {run["run_id"]: run_timeline(ledger, run) for run in ledger.runs()}
    # Newest run first: it is the one a reader opens the report for.
    runs = "".join(_run_section(ledger, timeline) for timeline in reversed(timelines.values()))
    sections = []
    for row in attempts:
        lines = attempt_account(row, run_dir) + neighbours(ledger, row, timelines.get(row.run_id))
        why = "".join(f"{esc(line)}\n" for line in lines)
        sections.append(
            f"<h2 id='{esc(row.step)}-{row.attempt}'>{esc(row.step)} attempt {row.attempt}: "
            f"<span style='color:{verdict_color(row.verdict)}'>"
            f"{esc(HEADLINE.get(row.verdict or '', 'Running'))}</span></h2>"
            f"{timeline_svg(row, ledger.timeline(row.id))}<pre>{why}</pre>"
        )
    pipeline = esc(latest["pipeline"]) if latest else ""
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{esc(title)}</h1>"
        f"<p class='muted'>{pipeline} · ledger {esc(ledger.path)} · generated {generated}</p>"
        f"{runs}<h2>Attempts</h2>"
        "<table><tr><th>step</th><th>attempt</th><th>verdict</th><th>exit</th><th>peak / limit</th>"
        f"<th>OOM kills</th><th>duration</th><th>records</th></tr>{''.join(rows)}</table>"
        f"{acceptance_table(run_dir, list(dict.fromkeys(a.step for a in attempts)))}"
        f"{''.join(sections)}</body></html>"
    )


def report_command(run_dir: Path | None, runs: Path, out: Path | None) -> int:
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)

    def write(ledger: Ledger, found: Path) -> int:
        target = out or found / REPORT_NAME
        if target.is_dir():  # never replaced: a folder is not ours to delete
            err.print(
                f"[red]error:[/] --out {escape(str(target))} is a folder; name the report's file, "
                f"e.g. --out {escape(str(target / REPORT_NAME))}",
                highlight=False,
                soft_wrap=True,
            )
            return EXIT_BAD_INPUT
        atomic_write_text(target, render(ledger, found))
        print(target)
        return 0

    return read_run(run_dir, runs, err, write)
