"""The step contract: what every step is given and what it must leave, whatever runs it.

A step runs in its own directory and finds its place in the environment the runner sets
(``EYRIE_RUN_DIR``, ``EYRIE_STEP_DIR``, ``EYRIE_STEP_NAME``, ``EYRIE_PIPELINE_DIR``). It
first removes the manifest of an earlier attempt (``invalidate_manifest``), writes each
output through a temporary name and renames it into place (``atomic.atomic_path``), then writes
``manifest.json`` in its step directory (``write_manifest``; a plain command runs ``eyrie
manifest OUTPUT…``). Outputs are complete when the manifest exists, every file it lists
still has the recorded size and sha256, and a folder output holds no file it does not list,
hidden ones included (``check_manifest``). The runner passes the step's input fingerprint in
``EYRIE_STEP_FINGERPRINT``; the manifest records it, so a rerun can tell whether the inputs
changed. The runner keeps its own files in the run directory under ``.eyrie/`` (``STATE_DIR``),
where a step finds the URLs its services answer at now (``service_urls``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from pipeline.contract.atomic import atomic_write_text, fsync_dir
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.memory.units import MIB

MANIFEST_NAME = "manifest.json"
RUN_DIR_ENV = "EYRIE_RUN_DIR"
STEP_DIR_ENV = "EYRIE_STEP_DIR"
STEP_NAME_ENV = "EYRIE_STEP_NAME"
PIPELINE_DIR_ENV = "EYRIE_PIPELINE_DIR"
FINGERPRINT_ENV = "EYRIE_STEP_FINGERPRINT"
CACHE_DIR_ENV = "EYRIE_CACHE_DIR"
SERVICE_PORT_ENV = "EYRIE_SERVICE_PORT"
"""A service's replica listens on this port (the runner chose it, free)."""
STATE_DIR = ".eyrie"
"""Where a run directory keeps eyrie's own files, beside the steps' folders."""
_HASH_CHUNK = MIB


def service_urls_env(service: str) -> str:
    """The variable a step that uses ``service`` finds its replicas' URLs in, comma-separated:
    ``EYRIE_SERVICE_TARGET_URLS`` for ``target``."""
    return "EYRIE_SERVICE_" + re.sub(r"[^A-Z0-9]", "_", service.upper()) + "_URLS"


def service_urls_path(run_dir: Path, service: str) -> Path:
    """Where the runner keeps the URLs ``service``'s replicas answer at now, one per line in replica
    order: rewritten when a replica started again answers elsewhere (a Slurm job on another node)."""
    return Path(run_dir) / STATE_DIR / "services" / f"{service}.urls"


def service_urls(service: str, environ: dict[str, str] | None = None) -> list[str]:
    """The URLs of ``service``'s replicas the runner gave this step, in replica order, as they are
    now: a replica started again elsewhere (a Slurm job on another node) answers at the URL the
    runner wrote to the run directory since; [] when it gave none."""
    environ = os.environ if environ is None else environ
    given = [url for url in environ.get(service_urls_env(service), "").split(",") if url]
    if not given or not environ.get(RUN_DIR_ENV):
        return given
    try:
        now = service_urls_path(Path(environ[RUN_DIR_ENV]), service).read_text(encoding="utf-8").split()
    except OSError:
        return given
    return now if len(now) == len(given) else given


class FileEntry(BaseModel):
    bytes: int
    sha256: str
    records: int | None = None


class Manifest(BaseModel):
    step: str | None = None
    fingerprint: str | None = None
    created_at: float
    outputs: dict[str, dict[str, FileEntry]]
    """Declared output (relative to the step dir) -> file under it (``.`` for a plain file) -> entry."""
    stats: dict[str, Any] = {}

    def records(self) -> int | None:
        counts = [e.records for files in self.outputs.values() for e in files.values()]
        known = [c for c in counts if c is not None]
        return sum(known) if known else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(_HASH_CHUNK), b""))


def _files_of(output: Path) -> dict[str, Path]:
    """Every file of an output, by its path in it (``.`` for a plain file): hidden ones too, so
    nothing added to a folder output goes unseen."""
    if output.is_dir():
        return {str(p.relative_to(output)): p for p in sorted(output.rglob("*")) if p.is_file()}
    return {".": output}


def write_manifest(
    step_dir: str | os.PathLike[str],
    outputs: list[str],
    *,
    records: dict[str, int] | None = None,
    stats: dict[str, Any] | None = None,
    step: str | None = None,
    fingerprint: str | None = None,
) -> Manifest:
    """Hash the finished outputs and write ``manifest.json`` atomically.

    ``records`` gives a record count per output (``.jsonl`` files are counted by
    lines when not given); ``stats`` is free-form (per-source counts, token totals).
    ``step`` and ``fingerprint`` default to what the runner put in the environment.
    """
    root = Path(step_dir)
    entries: dict[str, dict[str, FileEntry]] = {}
    for name in outputs:
        output = root / name
        if not output.exists():
            raise FileNotFoundError(f"declared output {name!r} does not exist in {root}")
        files = _files_of(output)
        entries[name] = {}
        for rel, file in files.items():
            count = (records or {}).get(name) if rel == "." else None
            if count is None and file.suffix == ".jsonl":
                count = _count_lines(file)
            entries[name][rel] = FileEntry(bytes=file.stat().st_size, sha256=sha256_file(file), records=count)
        if output.is_dir() and name in (records or {}):
            entries[name].setdefault(".", FileEntry(bytes=0, sha256="", records=records[name]))
    manifest = Manifest(
        step=step or os.environ.get(STEP_NAME_ENV),
        fingerprint=fingerprint or os.environ.get(FINGERPRINT_ENV),
        created_at=time.time(),
        outputs=entries,
        stats=stats or {},
    )
    atomic_write_text(root / MANIFEST_NAME, manifest.model_dump_json(indent=2))
    return manifest


def invalidate_manifest(step_dir: str | os.PathLike[str]) -> None:
    """Remove the step's manifest before its outputs are written again: an attempt that then fails
    must not leave the earlier outputs looking complete."""
    path = Path(step_dir) / MANIFEST_NAME
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def declare_outputs(outputs: list[str | os.PathLike[str]]) -> Manifest:
    """``eyrie manifest OUTPUT…``: the manifest of a step's finished outputs, as ``write_manifest``
    writes it for the step directory (the runner's, else the current one). Paths are relative to the
    current directory, which is the step directory when the runner started the command."""
    step_dir = step_dir_from_env().resolve()
    names = []
    for output in outputs:
        path = Path(os.path.abspath(output))
        if step_dir not in path.parents:
            raise ValueError(f"{output}: not inside the step directory {step_dir}; name outputs in it")
        if not path.exists():
            raise FileNotFoundError(f"{output}: no such file or folder in {step_dir}; write it first")
        names.append(str(path.relative_to(step_dir)))
    return write_manifest(step_dir, names)


def manifest_command(outputs: list[Path]) -> int:
    """``eyrie manifest``: the exit code; a bad output is one line, and no manifest is written."""
    from rich.console import Console
    from rich.markup import escape

    try:
        manifest = declare_outputs(outputs)
    except (ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT
    files = [entry for entries in manifest.outputs.values() for entry in entries.values()]
    print(
        f"manifest: {len(manifest.outputs)} output(s), {len(files)} file(s), "
        f"{sum(e.bytes for e in files):,} bytes -> {step_dir_from_env() / MANIFEST_NAME}"
    )
    return 0


def read_manifest(step_dir: str | os.PathLike[str]) -> Manifest | None:
    path = Path(step_dir) / MANIFEST_NAME
    try:
        return Manifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def check_manifest(step_dir: str | os.PathLike[str], declared: list[str] | None = None) -> tuple[bool, str]:
    """Whether the outputs are complete, and if not, why (one line)."""
    root = Path(step_dir)
    manifest = read_manifest(root)
    if manifest is None:
        return False, f"no valid {MANIFEST_NAME} in {root}"
    missing = [d for d in declared or [] if d not in manifest.outputs]
    if missing:
        return False, f"{MANIFEST_NAME} does not list declared output(s) {', '.join(missing)}"
    for name, files in manifest.outputs.items():
        output = root / name
        if output.is_dir() and (added := sorted(set(_files_of(output)) - set(files))):
            more = f" and {len(added) - 1} more" if len(added) > 1 else ""
            return False, f"{output / added[0]}{more} not in {MANIFEST_NAME}: added since it was written"
        for rel, entry in files.items():
            if rel == "." and output.is_dir():
                continue  # a folder's record count, not a file
            file = output if rel == "." else output / rel
            if not file.is_file():
                return False, f"{file} is listed in {MANIFEST_NAME} but missing"
            if file.stat().st_size != entry.bytes or sha256_file(file) != entry.sha256:
                return False, f"{file} changed since {MANIFEST_NAME} was written"
    return True, "manifest matches the files"


def manifest_digest(step_dir: str | os.PathLike[str]) -> str | None:
    """sha256 of a step's manifest outputs: what a downstream step's fingerprint depends on."""
    manifest = read_manifest(step_dir)
    if manifest is None:
        return None
    payload = json.dumps(
        {k: {f: e.sha256 for f, e in v.items()} for k, v in manifest.outputs.items()},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def step_dir_from_env() -> Path:
    """The step's working directory when run by eyrie, else the current directory."""
    return Path(os.environ.get(STEP_DIR_ENV, os.getcwd()))


def cache_root() -> Path:
    """Where steps keep what they rebuild only when its inputs change (``$EYRIE_CACHE_DIR``,
    default ``~/.cache/eyrie``): shared by runs, never part of one."""
    return Path(os.environ.get(CACHE_DIR_ENV, Path.home() / ".cache" / "eyrie"))


__all__ = [
    "MANIFEST_NAME",
    "STATE_DIR",
    "Manifest",
    "cache_root",
    "check_manifest",
    "declare_outputs",
    "invalidate_manifest",
    "manifest_digest",
    "read_manifest",
    "service_urls",
    "service_urls_path",
    "step_dir_from_env",
    "write_manifest",
]
