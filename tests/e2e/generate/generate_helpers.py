"""Helpers of the generation tests: the fake OpenAI server as a subprocess,
prompts, running the step. Not a conftest.py: the suite's root conftest is imported by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FAKE_SERVER = REPO / "tests" / "fakes" / "fake_openai_server.py"


class FakeServer:
    def __init__(self, *args: str, port: int = 0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(FAKE_SERVER), "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.process.kill()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def fake_servers() -> Iterator:
    """The body of the ``fake_server`` fixture: start fake servers (args as on its command line),
    kill them all after the test."""
    started: list[FakeServer] = []

    def start(*args: str, port: int = 0) -> FakeServer:
        server = FakeServer(*args, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def simple_prompts(path: Path, n: int, *, marker_every: dict[str, int] | None = None) -> Path:
    rows = []
    for i in range(n):
        content = f"question {i}"
        for marker, every in (marker_every or {}).items():
            if i % every == 0:
                content += f" {marker}"
        rows.append({"id": f"p{i:05d}", "source": "test", "messages": [{"role": "user", "content": content}]})
    return write_prompts(path, rows)


def generate_argv(prompts: Path, out_dir: Path, *urls: str, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "pipeline.cli", "generate", str(prompts), "--out-dir", str(out_dir)]
    for url in urls:
        argv += ["--url", url]
    return [*argv, "--retry-base", "0.02", "--health-timeout", "20s", *extra]


def run_generate(
    prompts: Path,
    out_dir: Path,
    *urls: str,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        generate_argv(prompts, out_dir, *urls, extra=extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
