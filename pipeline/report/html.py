"""``eyrie report``: one self-contained HTML file — the attempts table and each attempt's memory timeline.

No scripts, no external assets: it opens from disk, attaches to a ticket, and
prints. Each timeline is an inline SVG: total memory (page cache included),
anonymous memory, the limit, and the moment an OOM kill was counted.
"""

from __future__ import annotations

import html
import sqlite3
import time
from pathlib import Path

from pipeline.memory import format_duration, format_size
from pipeline.report.status import HEADLINE, exit_text, explain, unreadable
from pipeline.run.ledger import LEDGER_NAME, AttemptRow, Ledger
from pipeline.run.manifest import atomic_write_text, read_manifest

_W, _H, _PAD = 640, 160, 36
_COLORS = {
    "succeeded": "#1a7f37",
    "completed_then_crashed": "#9a6700",
    "timed_out": "#8250df",
    "cancelled": "#9a6700",
}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #1f2328; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 4px 8px; border-bottom: 1px solid #d0d7de; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, td.verdict { text-align: left; }
.verdict { font-weight: 600; } .muted { color: #656d76; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #656d76; }
"""


def _color(verdict: str | None) -> str:
    return _COLORS.get(verdict or "", "#cf222e" if verdict else "#0969da")


def timeline_svg(row: AttemptRow, points: list[tuple[float, int, int]]) -> str:
    """An SVG chart of one attempt's memory over time, with its limit and OOM kill."""
    if not points:
        return '<p class="muted">no timeline samples (the attempt ended within its first second)</p>'
    span = max(points[-1][0], row.wall_s or 0, 1e-3)
    top = max(row.limit_bytes, max(p[1] for p in points), 1)

    def x(t: float) -> float:
        return _PAD + (_W - 2 * _PAD) * t / span

    def y(v: int) -> float:
        return _H - _PAD / 2 - (_H - _PAD) * v / top

    def path(index: int) -> str:
        return " ".join(f"{x(p[0]):.1f},{y(p[index]):.1f}" for p in [(0.0, 0, 0), *points])

    parts = [
        f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
        f'aria-label="memory of {html.escape(row.step)} attempt {row.attempt}">',
        f'<line x1="{_PAD}" x2="{_W - _PAD}" y1="{y(row.limit_bytes):.1f}" y2="{y(row.limit_bytes):.1f}" '
        'stroke="#cf222e" stroke-dasharray="4 3"/>',
        f'<text x="{_W - _PAD + 2}" y="{y(row.limit_bytes) + 4:.1f}">limit</text>',
        f'<polyline fill="none" stroke="#0969da" stroke-width="1.5" points="{path(1)}"/>',
        f'<polyline fill="none" stroke="#8250df" stroke-width="1.5" stroke-dasharray="2 2" '
        f'points="{path(2)}"/>',
        f'<text x="{_PAD}" y="12">{html.escape(format_size(top))}</text>',
        f'<text x="{_PAD}" y="{_H - 4}">0 s</text>',
        f'<text x="{_W - _PAD - 30}" y="{_H - 4}">{span:.1f} s</text>',
        f'<text x="{_PAD + 60}" y="12" style="fill:#0969da">— total</text>',
        f'<text x="{_PAD + 110}" y="12" style="fill:#8250df">··· anonymous</text>',
    ]
    if row.oom_at is not None:
        t = min(max(row.oom_at - row.started_at, 0.0), span)
        parts.append(
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_PAD / 2}" y2="{_H - _PAD / 2}" stroke="#cf222e"/>'
            f'<text x="{x(t) + 3:.1f}" y="{_PAD / 2 + 10}" style="fill:#cf222e">OOM kill</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


# What a step that measured a draft (``eyrie accept``) keeps in its manifest's stats.
_ACCEPTANCE = [
    ("engine", "engine"),
    ("accept length", "accept_length"),
    ("output tok/s with the draft", "output_tokens_per_s"),
    ("output tok/s without", "baseline_output_tokens_per_s"),
    ("speed-up", "speedup"),
    ("prompts", "prompts"),
    ("steps / top-k / draft tokens", None),
]


def acceptance_table(run_dir: Path, steps: list[str]) -> str:
    """The draft's accept length and tokens/s, for each step whose manifest records them."""
    rows = []
    for step in steps:
        manifest = read_manifest(run_dir / step)
        stats = manifest.stats if manifest else {}
        if "accept_length" not in stats:
            continue
        cells = []
        for _, key in _ACCEPTANCE:
            value = (
                f"{stats.get('num_steps')} / {stats.get('topk')} / {stats.get('num_draft_tokens')}"
                if key is None
                else stats.get(key)
            )
            cells.append(f"<td>{html.escape('-' if value is None else str(value))}</td>")
        rows.append(f"<tr><td>{html.escape(step)}</td>{''.join(cells)}</tr>")
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in _ACCEPTANCE)
    return f"<h2>The draft</h2><table><tr><th>step</th>{head}</tr>{''.join(rows)}</table>"


def render(ledger: Ledger, run_dir: Path) -> str:
    attempts = ledger.attempts()
    latest = ledger.latest_run()
    title = f"eyrie run {latest['run_id']} — {latest['state']}" if latest else "eyrie ledger"
    rows = []
    for row in attempts:
        verdict = row.verdict or "running"
        rows.append(
            "<tr>"
            f"<td><a href='#{html.escape(row.step)}-{row.attempt}'>{html.escape(row.step)}</a></td>"
            f"<td>{row.attempt}</td>"
            f"<td class='verdict' style='color:{_color(row.verdict)}'>{html.escape(verdict)}</td>"
            f"<td>{html.escape(exit_text(row))}</td>"
            f"<td>{format_size(row.peak_bytes)} / {format_size(row.limit_bytes)}</td>"
            f"<td>{'-' if row.oom_kills is None else row.oom_kills}</td>"
            f"<td>{format_duration(row.wall_s)}</td>"
            f"<td>{'-' if row.records is None else f'{row.records:,}'}</td>"
            "</tr>"
        )
    sections = []
    for row in attempts:
        why = "".join(f"{html.escape(line)}\n" for line in explain(row, run_dir))
        sections.append(
            f"<h2 id='{html.escape(row.step)}-{row.attempt}'>{html.escape(row.step)} attempt {row.attempt}: "
            f"<span style='color:{_color(row.verdict)}'>"
            f"{html.escape(HEADLINE.get(row.verdict or '', 'Running'))}</span></h2>"
            f"{timeline_svg(row, ledger.timeline(row.id))}<pre>{why}</pre>"
        )
    pipeline = html.escape(latest["pipeline"]) if latest else ""
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p class='muted'>{pipeline} · ledger {html.escape(str(ledger.path))} · generated {generated}</p>"
        "<table><tr><th>step</th><th>attempt</th><th>verdict</th><th>exit</th><th>peak / limit</th>"
        f"<th>OOM kills</th><th>duration</th><th>records</th></tr>{''.join(rows)}</table>"
        f"{acceptance_table(run_dir, list(dict.fromkeys(a.step for a in attempts)))}"
        f"{''.join(sections)}</body></html>"
    )


def report_command(run_dir: Path, out: Path | None) -> int:
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    try:
        ledger = Ledger(run_dir, create=False)
    except FileNotFoundError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except sqlite3.Error as exc:
        return unreadable(run_dir / LEDGER_NAME, exc, err)
    try:
        page = render(ledger, run_dir)
    except sqlite3.Error as exc:
        return unreadable(ledger.path, exc, err)
    finally:
        ledger.close()
    target = out or run_dir / "report.html"
    atomic_write_text(target, page)
    print(target)
    return 0
