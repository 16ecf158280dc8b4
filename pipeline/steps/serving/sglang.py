"""SGLang as the pipeline uses it: its server's command line, requests to it, and its GPU memory.

Flags are those of the SGLang release the image pins (``images/sglang/Dockerfile``);
``tests/unit/accept/test_sglang.py`` parses every command line built here with that
release's own option table.

Failures come in two kinds. The server said no (an HTTP 4xx): ``SGLangRefused``, the
settings must change. The server did not answer, or answered that it cannot now
(connection refused or reset, a timeout, 408/429/5xx): ``SGLangUnavailable``, after
retries with backoff (as the generate step retries) where sending again is safe.

Handing the GPUs over (:func:`gpus_released`) is not idempotent: torch_memory_saver ends the
server's process when asked to release memory it already released, or to resume memory it
holds. So each of those two requests is sent again only when the server did not act on it
(the connection was refused, or it answered "not now"), and the run directory records a
release until its resume succeeded: a step that was killed before it could resume leaves the
record, and the next step finds the server still released and does not release it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.step import RUN_DIR_ENV, STATE_DIR, STEP_NAME_ENV
from pipeline.steps.serving.http_retry import TRANSIENT_STATUS, Retry
from pipeline.steps.serving.step_server import free_port, running_server


class SGLangError(RuntimeError):
    """The server refused or could not do what was asked; the message says which and why."""


class SGLangRefused(SGLangError):
    """The server answered no (an HTTP 4xx): asking again will not help, the settings must change."""


class SGLangUnavailable(SGLangError):
    """No answer, or "not now" (408/429/5xx), through every retry: a later attempt may succeed."""

    def __init__(self, message: str, *, undone: bool = False) -> None:
        super().__init__(message)
        self.undone = undone
        """The server did not act on the request: the connection was refused, or it answered "not now"."""


class Terminated(BaseException):
    """The step was asked to stop (SIGTERM: the runner's timeout or cancel), raised where the step
    was, so that what it holds is given back on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@dataclass(frozen=True)
class Speculation:
    """EAGLE-3 speculative decoding: ``num_steps`` draft passes, ``topk`` branches per pass, at most
    ``num_draft_tokens`` tokens verified per target forward (topk 1: a chain of num_steps + 1)."""

    draft: Path
    num_steps: int
    topk: int
    num_draft_tokens: int

    def as_served(self) -> Speculation:
        """What SGLang runs for these settings: with topk 1 it verifies the chain, num_steps + 1
        tokens, whatever num_draft_tokens says (v0.5.12, ``server_args.py``)."""
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            return dataclasses.replace(self, num_draft_tokens=self.num_steps + 1)
        return self


@dataclass(frozen=True)
class Parsers:
    """How the server splits a chat answer: its thinking into ``reasoning_content``
    (``--reasoning-parser``), its tool calls into ``tool_calls`` (``--tool-call-parser``). Names are
    SGLang's (Kimi-K2.5: ``kimi_k2`` for both); an empty one passes no flag."""

    reasoning: str = ""
    tool_call: str = ""

    def argv(self) -> list[str]:
        flags = (("--reasoning-parser", self.reasoning), ("--tool-call-parser", self.tool_call))
        return [arg for flag, name in flags if name for arg in (flag, name)]


def server_argv(
    model: str,
    *,
    port: int,
    tp: int,
    host: str = "127.0.0.1",
    trust_remote_code: bool = False,
    parsers: Parsers = Parsers(),
    speculation: Speculation | None = None,
) -> list[str]:
    """``python -m sglang.launch_server`` for ``model`` on ``host:port``, with or without a draft."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    argv += ["--host", host, "--port", str(port), "--tp-size", str(tp)]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    argv += parsers.argv()
    if speculation is not None:
        argv += [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(speculation.draft),
            "--speculative-num-steps", str(speculation.num_steps),
            "--speculative-eagle-topk", str(speculation.topk),
            "--speculative-num-draft-tokens", str(speculation.num_draft_tokens),
        ]  # fmt: skip  # a table: each flag beside its value
    return argv


@contextlib.contextmanager
def sglang_server(
    model: str,
    log_path: Path,
    *,
    tp: int,
    trust_remote_code: bool,
    parsers: Parsers,
    speculation: Speculation | None,
    startup_timeout_s: float,
) -> Iterator[str]:
    """An SGLang server for the block's duration, a child of the step; yields its base URL."""
    port = free_port()
    argv = server_argv(
        model, port=port, tp=tp, trust_remote_code=trust_remote_code, parsers=parsers, speculation=speculation
    )
    url = f"http://127.0.0.1:{port}"
    with running_server("sglang", argv, dict(os.environ), url, log_path, startup_timeout_s):
        yield url


def _send(url: str, payload: dict | None, timeout_s: float) -> dict:
    """One request: GET without ``payload``, else POST it as JSON; the answer's JSON."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip().splitlines()[:1]
        message = f"{url}: HTTP {exc.code}: {' '.join(detail) or exc.reason}"
        if exc.code in TRANSIENT_STATUS:
            raise SGLangUnavailable(message, undone=True) from None
        raise SGLangRefused(message) from None
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
        reason = getattr(exc, "reason", exc)
        raise SGLangUnavailable(
            f"{url}: {reason}", undone=isinstance(reason, ConnectionRefusedError)
        ) from None
    try:
        return json.loads(body) if body.strip() else {}
    except ValueError:
        raise SGLangUnavailable(f"{url}: an answer that is not JSON: {body[:200]!r}") from None


def request(url: str, payload: dict | None, timeout_s: float, *, retry: Retry, resend: bool = True) -> dict:
    """:func:`_send`, again after a transient fault, ``retry.max_retries`` times with backoff; with
    ``resend`` False only when the server did not act on it (a request that may have been done,
    its answer lost, is not sent twice)."""
    attempt = 0
    while True:
        try:
            return _send(url, payload, timeout_s)
        except SGLangUnavailable as exc:
            if attempt >= retry.max_retries or not (resend or exc.undone):
                raise
            time.sleep(retry.delay(attempt))
            attempt += 1


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float, retry: Retry) -> dict:
    """Greedy completion of ``input_ids`` on SGLang's native ``/generate``; returns its ``meta_info``
    (``completion_tokens``, and ``spec_verify_ct`` — target forwards — with speculation). Greedy and
    stateless: sending it again is safe."""
    answer = request(
        url + "/generate",
        {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}},
        timeout_s,
        retry=retry,
    )
    return answer["meta_info"]


def release_url(option: str) -> str | None:
    """``--release-target``: a server's URL, or ``no``."""
    return None if option.strip().lower() in ("", "no", "none") else option


@contextlib.contextmanager
def terminated_as_exception() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread for the block's duration, once: the
    runner keeps sending it through its grace period, and the cleanup it starts must finish."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """What gives a resource back is not interrupted by the runner's repeated SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def release_record(url: str, step_dir: Path) -> Path:
    """Where the run directory (``$EYRIE_RUN_DIR``, else the step's folder) records that ``url``'s
    GPU memory is released and not yet taken back."""
    run_dir = Path(os.environ.get(RUN_DIR_ENV) or step_dir)
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return run_dir / STATE_DIR / f"released-target-{digest}.json"


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


@contextlib.contextmanager
def gpus_released(
    url: str | None,
    step_dir: Path,
    *,
    timeout_s: float = 600,
    retry: Retry | None = None,
    say: Callable[[str], None] = _say,
) -> Iterator[None]:
    """The SGLang server at ``url`` gives back its GPU memory (weights, KV cache, CUDA graphs)
    for the block's duration, and takes it again afterwards; ``None``: nothing to release.

    The server must run with ``--enable-memory-saver``, and with ``--enable-weights-cpu-backup``
    to serve again afterwards (compose/compose.yaml starts it so): torch_memory_saver otherwise
    throws the released weights away, and a server that resumed would compute with garbage, so
    such a server is left released, to be restarted. SIGTERM inside the block raises
    :class:`Terminated`, so the memory is taken back on the way out. A failure to take it back
    is said, never raised: it must not replace what the block did.
    """
    if url is None:
        yield
        return
    retry = retry or Retry()
    base = url.rstrip("/")
    record = release_record(base, step_dir)
    with terminated_as_exception():
        info = request(base + "/server_info", None, timeout_s, retry=retry)
        if info.get("enable_memory_saver") is False:
            raise SGLangRefused(
                f"the target server {base} cannot give back its GPU memory: it runs without "
                "--enable-memory-saver (start it with that flag, or set --release-target no when it "
                "holds none of these GPUs)"
            )
        # Drawn at every start of the server (unless given with --random-seed): a record of an
        # earlier start does not describe this one.
        started = info.get("random_seed")
        held = _read_record(record)
        if held is not None and held.get("server") == started:
            say(
                f"the target server {base} is still released by {held.get('by')}, which did not take "
                "its memory back: it is not released again"
            )
        else:
            if held is not None:
                say(f"{record} describes an earlier start of the target server {base}: set aside")
            _release(base, record, started, timeout_s, retry)
        try:
            yield
        finally:
            with _sigterm_ignored():
                _resume(base, record, info, timeout_s, retry, say)


def _release(base: str, record: Path, started, timeout_s: float, retry: Retry) -> None:
    step = os.environ.get(STEP_NAME_ENV) or "eyrie"
    by = f"step {step} (pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')})"
    atomic_write_text(record, json.dumps({"url": base, "server": started, "by": by}) + "\n")
    try:
        request(base + "/release_memory_occupation", {}, timeout_s, retry=retry, resend=False)
    except SGLangRefused as exc:
        record.unlink(missing_ok=True)
        raise SGLangRefused(f"the target server refused to give back its GPU memory: {exc}") from None
    except SGLangUnavailable as exc:
        if exc.undone:  # anything else may have released the memory, and the record says so
            record.unlink(missing_ok=True)
        raise SGLangUnavailable(f"cannot reach the target server to release its GPU memory: {exc}") from None


def _resume(base: str, record: Path, info: dict, timeout_s: float, retry: Retry, say) -> None:
    if info.get("enable_weights_cpu_backup") is False:
        say(
            f"the target server {base} stays released: it keeps no copy of its weights "
            "(--enable-weights-cpu-backup), so resuming would serve garbage; restart it to serve "
            "again (docker compose restart sglang)"
        )
        return
    try:
        request(base + "/resume_memory_occupation", {}, timeout_s, retry=retry, resend=False)
    except SGLangError as exc:
        say(
            f"warning: the target server {base} did not take its GPU memory back: {exc}; {record} "
            "tells the next step that it is still released (or restart the server)"
        )
        return
    record.unlink(missing_ok=True)
