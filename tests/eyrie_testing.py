"""Helpers shared by the test suites: where the repository is, the real `eyrie` command line, and
the report as a real browser draws it.

A module of its own (not conftest.py) so that every test imports the same one,
whatever other conftest.py files pytest has loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from PIL import Image

from pipeline.report.chart import AVAILABLE_COLOR, BUDGET_COLOR, GRID_COLOR, OTHER_COLOR

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "tests" / "scenarios" / "scenarios.yaml"
PLAYBOOK = REPO / "ansible" / "playbooks" / "provision.yml"


def playbook_roles() -> list[str]:
    """The roles the provisioning playbook applies, in its order: adding a role is adding it there."""
    (play,) = yaml.safe_load(PLAYBOOK.read_text())
    return [entry["role"] if isinstance(entry, dict) else entry for entry in play["roles"]]


def eyrie(
    *args: str, check: bool = False, timeout: float = 300, settings: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the real `eyrie` command line in a subprocess (``settings``: on top of this environment)."""
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
        env={**os.environ, **(settings or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"eyrie {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def eyrie_in_small_cgroup(
    limit_bytes: int, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """The real `eyrie ARGS…` started in a fresh memory cgroup limited to ``limit_bytes``, as a runner
    in a small container or scope on a roomy host is; the cgroup is removed once it ends."""
    from pipeline.memory import step_parent

    cgroup = step_parent().child(f"eyrie-test-{uuid.uuid4().hex[:8]}")
    cgroup.create()
    try:
        cgroup.set_limit(limit_bytes)
        return subprocess.run(
            [
                "sh",
                "-c",
                'echo $$ > "$0/cgroup.procs" && exec "$@"',
                str(cgroup.path),
                sys.executable,
                "-m",
                "pipeline.cli",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=env or dict(os.environ),
        )
    finally:
        for below, _, _ in os.walk(cgroup.path, topdown=False):
            os.rmdir(below)  # the runner's own step parent, then the cgroup: empty once it ended


def attempts_json(run_dir: Path) -> list[dict]:
    return json.loads(eyrie("status", "--run-dir", str(run_dir), "--json", check=True).stdout)


# -- the documentation pages (docs/, built by mkdocs.yml) ---------------------------------------
DOCS = REPO / "docs"


def docs_page(name: str) -> str:
    """The text of the page ``docs/NAME.md`` (``name``: "ledger", "steps/train", …)."""
    return (DOCS / f"{name}.md").read_text(encoding="utf-8")


def docs_text() -> str:
    """Every page's text, one after another: where an example is, not which page, is what matters."""
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted(DOCS.rglob("*.md")))


def docs_section(name: str, title: str) -> str:
    """The text under the heading ``title`` of page ``name``, up to the next heading of its level or
    above (or the page's end); ``#`` lines in code blocks are no headings."""
    lines, fence, level, found = docs_page(name).splitlines(), False, 0, []
    for line in lines:
        fence = fence != line.startswith("```")
        heading = None if fence or line.startswith("```") else re.match(r"^(#+) (.*)$", line)
        if heading and level and len(heading.group(1)) <= level:
            break
        if level:
            found.append(line)
        elif heading and heading.group(2) == title:
            level = len(heading.group(1))
    assert level, f"docs/{name}.md has no section {title!r}"
    return "\n".join(found) + "\n"


# -- the real job on CPU settings ---------------------------------------------------------------
REAL_JOB = REPO / "pipeline" / "jobs" / "eagle3.yaml"
CPU_ENV = REPO / "compose" / "cpu.env"


def env_file_settings(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of ``path`` (an env file, as `docker compose --env-file` and the shell's
    `.` read it: no quotes, no spaces); blank lines and ``#`` comments skipped."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


# The settings every CPU run of the real job takes (compose, `make cpu`, these tests); the file
# serves the tiny target itself, which each test makes and names (EYRIE_TARGET_MODEL).
REAL_JOB_CPU_SETTINGS = env_file_settings(CPU_ENV)
# Every step of the real job and its target's one replica: (step, replica) -> verdict.
REAL_JOB_SUCCEEDED = {
    **{(step, None): "succeeded" for step in ("prep", "generate", "tokenize", "train", "accept")},
    ("target", 1): "succeeded",
}


def run_real_job(run_dir: Path, settings: dict[str, str], *args: str, timeout: float = 1500) -> list[dict]:
    """`eyrie run` of the real pipeline file into ``run_dir`` with ``settings`` on top of this
    environment (and ``args``: an executor), asserted to succeed; its attempts."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(REAL_JOB), "--run-dir", str(run_dir), *args],
        cwd=REPO,
        env={**os.environ, **settings},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return attempts_json(run_dir)


# -- a target replica killed mid-generate -------------------------------------------------------
def kill_target_mid_generate(
    tmp_path: Path, target: Path, replica_pid: Callable[[Path], int | None], *args: str, prompts: int = 60
) -> str:
    """`eyrie run` (``args``: an executor) of generate against ``target`` served by `eyrie serve
    --engine transformers` as the pipeline's service; once a few rows are in, its replica (the pid
    ``replica_pid`` finds from the run directory) is killed with SIGKILL. Asserted: the run
    succeeds, no row is lost or repeated, and the replica was recorded crashed, then started again.
    The run's output."""
    path = tmp_path / "prompts.jsonl"
    asked = [
        {"id": f"p{i:03d}", "source": "t", "messages": [{"role": "user", "content": f"q {i}"}]}
        for i in range(prompts)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in asked))
    spec = {
        "name": "target-service",
        "services": [
            {
                "name": "target",
                "command": ["eyrie", "serve", str(target), "--engine", "transformers"],
                "memory": "3GiB",
                "startup_timeout": "5m",
                "retries": 1,
            }
        ],
        "steps": [
            {
                "name": "generate",
                "command": [
                    "eyrie",
                    "generate",
                    str(path),
                    "--max-tokens",
                    "32",
                    "--seed",
                    "7",
                    "--concurrency",
                    "2",
                    "--health-timeout",
                    "5m",
                    "--retry-base",
                    "0.2",
                ],
                "memory": "1GiB",
                "uses": ["target"],
                "outputs": ["conversations.jsonl", "errors.jsonl"],
            }
        ],
    }
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # generate appends rows to its partial file as they are answered: kill the server once a few
    # are in; the file is renamed conversations.jsonl when the step completes.
    partial = run_dir / "generate" / "conversations.partial.jsonl"
    deadline = time.monotonic() + 600
    answered = 0
    while runner.poll() is None and time.monotonic() < deadline:
        answered = partial.read_bytes().count(b"\n") if partial.exists() else 0
        if answered >= 5 and (pid := replica_pid(run_dir)):
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"no replica to kill mid-generate:\n{runner.communicate()[0]}")
    out, _ = runner.communicate(timeout=600)
    assert runner.returncode == 0, out
    assert answered < prompts, "generate had answered every prompt before the kill"

    rows = (run_dir / "generate" / "conversations.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in rows) == [f"p{i:03d}" for i in range(prompts)]
    first, second = [a for a in attempts_json(run_dir) if a["step"] == "target"]
    assert (first["verdict"], first["signal"], first["replica"]) == ("crashed", signal.SIGKILL, 1)
    assert second["verdict"] == "succeeded" and second["replica"] == 1
    assert "target[1]: crashed" in out and "starting it again (1 of 1 retries)" in out
    return out


# -- the report, in a real browser --------------------------------------------------------------
CHROMIUM = shutil.which("chromium")
_HEADLESS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--force-device-scale-factor=1",
    "--force-color-profile=srgb",
    "--hide-scrollbars",
]


def screenshot(page: Path, png: Path, height: int = 1400) -> Path:
    """A PNG of ``page`` as Debian's chromium draws it, 1150 px wide (the report's width and margins)."""
    if CHROMIUM is None:
        pytest.skip(
            "chromium is not installed (apt-get install chromium): the report is checked in a real browser"
        )
    profile = png.with_name(png.stem + "-profile")
    profile.mkdir()  # a new, empty profile for every run
    subprocess.run(
        [
            CHROMIUM,
            *_HEADLESS,
            f"--user-data-dir={profile}",
            f"--window-size=1150,{height}",
            f"--screenshot={png}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return png


# Marks each text of a run chart that the browser draws outside the chart's width. Added to a copy
# of the page only: the report itself holds no script.
_MARK_OVERFLOW = """<script>
for (const svg of document.querySelectorAll("svg.run-chart")) {
  const width = Number(svg.getAttribute("width"));
  for (const text of svg.querySelectorAll("text")) {
    const box = text.getBBox();
    if (box.x < 0 || box.x + box.width > width) text.setAttribute("data-overflow", "");
  }
}
</script>"""


def overflowing_text(page: Path) -> list[str]:
    """The texts of a report's run chart that Debian's chromium draws past the chart's edges (cut off)."""
    if CHROMIUM is None:
        pytest.skip(
            "chromium is not installed (apt-get install chromium): the report is checked in a real browser"
        )
    marked = page.with_name(page.stem + "-marked.html")
    marked.write_text(page.read_text().replace("</body>", _MARK_OVERFLOW + "</body>"))
    profile = marked.with_name(marked.stem + "-profile")
    profile.mkdir()
    dom = subprocess.run(
        [
            CHROMIUM,
            *_HEADLESS,
            f"--user-data-dir={profile}",
            "--window-size=1150,1400",
            "--dump-dom",
            marked.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "run-chart" in dom, "the browser drew no run chart"
    return re.findall(r"<text [^>]*data-overflow[^>]*>([^<]*)</text>", dom)


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def chart_pixels(png: Path, page: str, colors: dict[str, str]) -> dict[str, int]:
    """How many pixels of each colour the first run chart of a report's screenshot holds.

    Only the chart's own box counts (the legend and the page around it are left out), so a
    series counts only if the chart draws it. The box is found from the chart's markup (its
    size, its topmost grid line) and the screenshot (where that grid line was drawn).
    """
    svg = re.search(r'<svg class="run-chart"[^>]* width="(\d+)" height="(\d+)".*?</svg>', page, re.S)
    assert svg, "the report has no run chart"
    width, height = int(svg.group(1)), int(svg.group(2))
    grid_lines = re.findall(
        rf'<line x1="(\d+)" x2="\d+" y1="(\d+)\.5" y2="\d+\.5" stroke="{GRID_COLOR}"', svg.group(0)
    )
    assert grid_lines, "the run chart has no axis ticks"
    grid_left, grid_top = min(int(x) for x, _ in grid_lines), min(int(y) for _, y in grid_lines)
    image = Image.open(png).convert("RGB")
    pixels, grid = image.load(), _rgb(GRID_COLOR)
    row = next(
        (y for y in range(image.height) if sum(pixels[x, y] == grid for x in range(image.width)) >= 100), None
    )
    assert row is not None, f"{png}: no grid line drawn: the chart is not there"
    left = next(x for x in range(image.width) if pixels[x, row] == grid) - grid_left
    top = row - grid_top
    histogram = image.crop((left, top, left + width, top + height)).getcolors(maxcolors=1 << 24)
    counts = {}
    for name, color in colors.items():
        wr, wg, wb = _rgb(color)
        counts[name] = sum(n for n, (r, g, b) in histogram if max(abs(r - wr), abs(g - wg), abs(b - wb)) <= 6)
    return counts


def step_colors_of(page: str) -> dict[str, str]:
    """The colour the report's first legend gives each step (the steps come first in it)."""
    legend = page[page.index("<ul class='legend'>") :]
    legend = legend[: legend.index("</ul>")]
    return dict(
        (name, color) for color, name in re.findall(r"background:(#[0-9a-f]{6})'></i>([^<]+)</li>", legend)
    )


def check_run_chart(page: str, png: Path, steps: list[str]) -> None:
    """Fails unless the first run chart of ``page``, as ``png`` shows it, draws every series."""
    colors = step_colors_of(page)
    assert set(steps) <= set(colors), f"the legend names no colour for {set(steps) - set(colors)}"
    assert len({colors[s] for s in steps}) == len(steps), "two steps share a colour"
    series = {
        **{f"step {s}": colors[s] for s in steps},
        "host memory in use beside the steps": OTHER_COLOR,
        "MemAvailable": AVAILABLE_COLOR,
        "the budget": BUDGET_COLOR,
    }
    drawn = chart_pixels(png, page, series)
    missing = {name: n for name, n in drawn.items() if n < 300}
    assert not missing, f"series not drawn (pixels seen: {missing}); all: {drawn}"


def perturbed_draft(target, draft_vocab: int | None = None, layer_ids=(0, 2, 3), seed: int = 1):
    """An untrained EAGLE-3 draft for ``target`` whose logits differ from one token to the next:
    the target's embedding, a vocabulary map keeping the lowest ids, weights nudged off random init
    (too close to uniform to tell logits apart)."""
    import torch

    from pipeline.steps.eagle3.model import Eagle3Draft, draft_config, vocab_map

    torch.manual_seed(seed)
    vocab = draft_vocab or target.config.vocab_size
    d2t, t2d = vocab_map(torch.arange(target.config.vocab_size).flip(0), vocab)
    draft = Eagle3Draft(draft_config(target.config, vocab, list(layer_ids)))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return draft.eval()
