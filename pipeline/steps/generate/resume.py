"""The generation step's files, kept across runs: which prompts are done, what their rows were made
with, and the partial files renamed into place at the end.

Files in the step directory:

- ``conversations.partial.jsonl`` / ``errors.partial.jsonl``: append-only while the
  step runs, flushed and fsynced in batches (``store.py``). A rerun (after a kill, a crash,
  a dead server) skips every id already in either file. ``errors`` holds final answers only
  (the server rejected the request, or the row cannot be asked); a row whose request
  kept failing transiently is written nowhere, so a rerun asks it again.
- ``generate.settings.json``: what the rows were made with (``config.settings_of``). A rerun
  with other settings (model, mode, sampling) refuses to mix answers; ``--restart`` moves the
  earlier rows into ``restarted/STAMP/`` and starts over.
- On success both partial files are renamed to ``conversations.jsonl`` and
  ``errors.jsonl`` and the manifest is written with the summary. Rows whose prompt the
  prompt file no longer holds (a smaller quota, an edited catalog) move to
  ``not-in-prompts/``, appended there: answers are never deleted unasked.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeline.contract.atomic import atomic_path, fsync_dir
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import MANIFEST_NAME
from pipeline.steps.generate.config import GenerateConfig, settings_diff, settings_of
from pipeline.steps.generate.conversation import Mode
from pipeline.steps.generate.json_text import loads
from pipeline.steps.generate.store import StoreError, read_ids, repair_tail

CONVERSATIONS = "conversations.jsonl"
ERRORS = "errors.jsonl"
OUTPUTS = [CONVERSATIONS, ERRORS]
SETTINGS = "generate.settings.json"
RESTARTED = "restarted"
NOT_IN_PROMPTS = "not-in-prompts"


def partial_name(final: str) -> str:
    return final.replace(".jsonl", ".partial.jsonl")


class GenerateError(Exception):
    """A one-line reason the step cannot run; exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


# -- input --------------------------------------------------------------------------------
def scan_prompts(path: Path, limit: int | None) -> list[str]:
    """The unique ids of the prompt file in order (first occurrence wins)."""
    if not path.is_file():
        raise GenerateError(f"prompts file {path} does not exist: run the prep step first")
    ids: list[str] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row_id = loads(line)["id"]
            except (ValueError, KeyError, TypeError):
                raise GenerateError(
                    f"{path}:{number} is not a prompt row (a JSON object with an id, as the prep step writes)"
                ) from None
            if row_id not in seen:
                seen.add(row_id)
                ids.append(row_id)
                if limit is not None and len(ids) >= limit:
                    break
    return ids


def iter_todo(path: Path, todo: set[str]) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = loads(line)
            if row["id"] in todo:
                todo.discard(row["id"])
                yield row


# -- state --------------------------------------------------------------------------------
def prepare_state(config: GenerateConfig, model: str, console: Console) -> tuple[set[str], int]:
    """Put the partial files in place for this run; returns (ids done, bytes of torn tails cut).

    Rows made with other settings are never mixed with new ones nor deleted: without
    ``--restart`` the step refuses to run, with it they are moved aside first.
    """
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    settings = settings_of(config, model)
    settings_path = out / SETTINGS
    previous = _read_settings(settings_path)
    names = [name for final in OUTPUTS for name in (final, partial_name(final))]
    earlier = [out / name for name in names if (out / name).exists()]
    if earlier and previous != settings and not config.restart:
        raise GenerateError(
            f"the rows in {out} were made with other settings "
            f"({_differs(previous, settings)}); rerun with the same settings to resume them, "
            "or add --restart (in a pipeline file's run: EYRIE_GENERATE_RESTART=1, once) to move them "
            "aside and start over"
        )
    if earlier and config.restart:
        aside = set_aside(out, [*earlier, settings_path, out / MANIFEST_NAME])
        console.print(f"generate: --restart: the earlier rows are kept in {aside}", markup=False)
    # From here until the end the outputs are being changed: no manifest may vouch for them.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for final in OUTPUTS:
        partial = out / partial_name(final)
        # A finished (or manifest-less) earlier attempt: resume from it like any partial.
        if (out / final).exists() and not partial.exists():
            os.replace(out / final, partial)
    with atomic_path(settings_path) as tmp:
        tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))
    cut = 0
    done: set[str] = set()
    for final in OUTPUTS:
        partial = out / partial_name(final)
        if final == ERRORS and config.retry_errors and partial.exists():
            partial.unlink()
            continue
        cut += repair_tail(partial)
        try:
            done.update(read_ids(partial))
        except StoreError as exc:
            raise GenerateError(str(exc)) from None
    return done, cut


def _read_settings(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _differs(previous: dict[str, Any] | None, settings: dict[str, Any]) -> str:
    if previous is None:
        return f"no readable {SETTINGS} beside them"
    return settings_diff(previous, settings)


def set_aside(out: Path, paths: list[Path]) -> Path:
    """Move the files of ``paths`` that exist into a new ``out/restarted/STAMP/``; returns it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    parent = out / RESTARTED
    parent.mkdir(exist_ok=True)
    aside, n = parent / stamp, 1
    while True:
        try:
            aside.mkdir()
            break
        except FileExistsError:
            n += 1
            aside = parent / f"{stamp}-{n}"
    for path in paths:
        if path.exists():
            os.replace(path, aside / path.name)
    fsync_dir(aside)
    fsync_dir(out)
    return aside


# -- the end ------------------------------------------------------------------------------
def finalize(out: Path, input_ids: set[str], requested_mode: Mode) -> dict[str, Any]:
    """Rename the partial files into place (deduplicated, only current input ids); whole-file stats."""
    stats: dict[str, Any] = {
        "conversations": 0,
        "errors": 0,
        "errors_by_kind": {},
        "truncated": 0,
        "fallback_last_turn": 0,
        "tokens_in": 0,
        "tokens_out": 0,
        "not_in_prompts": 0,
    }
    seen: set[str] = set()
    for final in (CONVERSATIONS, ERRORS):
        partial = out / partial_name(final)
        partial.touch()
        keep: list[bytes] = []
        gone: list[bytes] = []
        rewrite = False
        with open(partial, "rb") as fh:
            for line in fh:
                row = loads(line)
                if row["id"] in seen or row["id"] not in input_ids:
                    rewrite = True
                    if row["id"] not in input_ids:
                        gone.append(line)
                    continue
                seen.add(row["id"])
                keep.append(line)
                if final == CONVERSATIONS:
                    stats["conversations"] += 1
                    stats["truncated"] += bool(row.get("truncated"))
                    stats["fallback_last_turn"] += requested_mode != row.get("mode")
                    usage = row.get("usage") or {}
                    stats["tokens_in"] += usage.get("prompt_tokens", 0)
                    stats["tokens_out"] += usage.get("completion_tokens", 0)
                else:
                    stats["errors"] += 1
                    kinds = stats["errors_by_kind"]
                    kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
        if gone:  # kept before the partial file goes (a crash between may keep them twice, never none)
            stats["not_in_prompts"] += len(gone)
            _append_durably(out / NOT_IN_PROMPTS / final, gone)
        if rewrite:
            with atomic_path(out / final) as tmp:
                tmp.write_bytes(b"".join(keep))
            partial.unlink()
        else:
            os.replace(partial, out / final)
    fsync_dir(out)
    return stats


def _append_durably(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(exist_ok=True)
    with open(path, "ab") as fh:
        fh.writelines(lines)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(path.parent)
