"""Serve a model for the duration of a step: ``transformers serve``, or any server (``running_server``).

The embedded default has no SGLang server: the generation step starts the Hugging
Face server on a free loopback port (offline, CPU), waits for ``/health`` and stops
it when the step ends. The server is a child of the step, so it runs inside the
step's cgroup and its memory counts against the step's limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ServeError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _transformers_cli() -> list[str]:
    # The console script next to this interpreter, so the venv's transformers serves.
    script = Path(sys.executable).with_name("transformers")
    if script.exists():
        return [str(script)]
    found = shutil.which("transformers")
    if found:
        return [found]
    raise ServeError("the `transformers` command is not installed: pip install 'transformers[serving]'")


def _die_with_parent() -> None:
    # A step killed with SIGKILL cannot stop its server: the kernel does (PR_SET_PDEATHSIG).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def transformers_serve(
    model_dir: Path, log_path: Path, *, startup_timeout_s: float = 300, continuous_batching: bool = False
) -> Iterator[str]:
    """Start ``transformers serve MODEL_DIR`` on 127.0.0.1 and yield its base URL once healthy.

    ``continuous_batching`` turns on the server's paged-attention batching, so requests in
    flight are decoded together (without it they are answered one after another).
    """
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise ServeError(f"{model_dir} is not a model folder (no config.json): build the target first")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = transformers_argv(model_dir, host="127.0.0.1", port=port, continuous_batching=continuous_batching)
    with running_server("transformers serve", argv, transformers_env(), url, log_path, startup_timeout_s):
        yield url


def transformers_argv(model_dir: Path, *, host: str, port: int, continuous_batching: bool) -> list[str]:
    """``transformers serve MODEL_DIR`` on ``host:port``."""
    argv = [*_transformers_cli(), "serve", str(model_dir)]
    argv += ["--host", host, "--port", str(port), "--log-level", "warning"]
    if continuous_batching:
        # Without a fixed size the paged KV cache is sized from the host's memory (measured:
        # 14 GiB resident for the tiny target, 28 s before the first answer); 512 blocks of
        # 32 tokens hold 16k tokens in flight and peaked at 1.3 GiB.
        argv += ["--continuous-batching", "--cb-num-blocks", "512", "--cb-block-size", "32"]
    return argv


def transformers_env() -> dict[str, str]:
    """The environment ``transformers serve`` runs in: offline, one intra-op thread unless the
    operator says otherwise (for a small model on a busy CPU, OpenMP threads spin against each
    other: 32 tokens took 7.1 s on 2 threads of a loaded 2-core machine, 0.8 s on one; concurrency
    comes from requests, not from threads)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@contextlib.contextmanager
def running_server(
    name: str, argv: list[str], env: dict[str, str], url: str, log_path: Path, startup_timeout_s: float
) -> Iterator[None]:
    """Run a server as the step's child (in its cgroup, stopped with it) until the block ends;
    the block starts once ``URL/health`` answers 200."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    try:
        _wait_healthy(name, process, url, log_path, startup_timeout_s)
        yield
    finally:
        _stop(process)


def _wait_healthy(name: str, process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServeError(
                f"{name} exited with {process.returncode} before it was healthy "
                f"(log {log_path}: {_tail(log_path)})"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise ServeError(f"{name} at {url} was not healthy after {timeout_s:.0f}s (log {log_path})")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
