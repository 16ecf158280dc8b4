"""SGLang as the pipeline uses it: its server's command line, requests to it, and its GPU memory.

Flags are those of the SGLang release the image pins (``images/sglang/Dockerfile``);
``tests/unit/accept/test_sglang.py`` parses every command line built here with that
release's own option table.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.steps.generate.serve import free_port, running_server


class SGLangError(RuntimeError):
    """The server refused or could not do what was asked; the message says which and why."""


@dataclass(frozen=True)
class Speculation:
    """EAGLE-3 speculative decoding: ``num_steps`` draft passes, ``topk`` branches per pass, at most
    ``num_draft_tokens`` tokens verified per target forward (topk 1: a chain of num_steps + 1)."""

    draft: Path
    num_steps: int
    topk: int
    num_draft_tokens: int


def server_argv(
    model: str,
    *,
    port: int,
    tp: int,
    trust_remote_code: bool = False,
    speculation: Speculation | None = None,
) -> list[str]:
    """``python -m sglang.launch_server`` for ``model`` on 127.0.0.1, with or without a draft."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
            "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp)]  # fmt: skip
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if speculation is not None:
        argv += [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(speculation.draft),
            "--speculative-num-steps", str(speculation.num_steps),
            "--speculative-eagle-topk", str(speculation.topk),
            "--speculative-num-draft-tokens", str(speculation.num_draft_tokens),
        ]  # fmt: skip
    return argv


@contextlib.contextmanager
def sglang_server(
    model: str, log_path: Path, *, tp: int, trust_remote_code: bool, speculation: Speculation | None,
    startup_timeout_s: float,
) -> Iterator[str]:  # fmt: skip
    """An SGLang server for the block's duration, a child of the step; yields its base URL."""
    port = free_port()
    argv = server_argv(model, port=port, tp=tp, trust_remote_code=trust_remote_code, speculation=speculation)
    url = f"http://127.0.0.1:{port}"
    with running_server("sglang", argv, dict(os.environ), url, log_path, startup_timeout_s):
        yield url


def post_json(url: str, payload: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip().splitlines()[:1]
        raise SGLangError(f"{url}: HTTP {exc.code}: {' '.join(detail) or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SGLangError(f"{url}: {getattr(exc, 'reason', exc)}") from None
    return json.loads(body) if body.strip() else {}


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float) -> dict:
    """Greedy completion of ``input_ids`` on SGLang's native ``/generate``; returns its ``meta_info``
    (``completion_tokens``, and ``spec_verify_ct`` — target forwards — with speculation)."""
    answer = post_json(
        url + "/generate",
        {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}},
        timeout_s,
    )
    return answer["meta_info"]


def release_url(option: str) -> str | None:
    """``--release-target``: a server's URL, or ``no``."""
    return None if option.strip().lower() in ("", "no", "none") else option


@contextlib.contextmanager
def gpus_released(url: str | None, timeout_s: float = 600) -> Iterator[None]:
    """The SGLang server at ``url`` gives back its GPU memory (weights, KV cache, CUDA graphs)
    for the block's duration, and takes it again afterwards; ``None``: nothing to release.

    The server must run with ``--enable-memory-saver`` (the compose file starts it so): it
    serves the generation step, then the training and acceptance steps need its GPUs.
    """
    if url is None:
        yield
        return
    base = url.rstrip("/")
    try:
        post_json(base + "/release_memory_occupation", {}, timeout_s)
    except SGLangError as exc:
        raise SGLangError(
            f"cannot release the target server's GPU memory: {exc} (start SGLang with "
            "--enable-memory-saver, or set --release-target no when it holds none of these GPUs)"
        ) from None
    try:
        yield
    finally:
        post_json(base + "/resume_memory_occupation", {}, timeout_s)
