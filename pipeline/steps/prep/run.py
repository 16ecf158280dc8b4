"""``eyrie prep``: a catalog of sources in, ``prompts.jsonl`` + native conversations + native tokens out.

Sources run in parallel worker processes, as many as the step's memory budget
holds (``pipeline.memory.plan_workers``: the budget over ``--worker-memory``, at most one per CPU);
workers left over once every source has one read slices of the sources without a
quota. Each source (slice) writes its own part; the merge then dedups across
sources (first source in catalog order wins), shuffles deterministically with the
seed, and writes the outputs atomically. A failed source, or one with 0 accepted records, fails
the step with the per-source table, and no output is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import multiprocessing
import os
import shutil
import socket
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.contract.atomic import atomic_path
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import invalidate_manifest, step_dir_from_env, write_manifest
from pipeline.memory.budget import plan_workers
from pipeline.memory.units import format_size, parse_size
from pipeline.steps.options import settings_keywords
from pipeline.steps.prep.catalog import Catalog, CatalogError, load_catalog
from pipeline.steps.prep.config import PrepConfig
from pipeline.steps.prep.sources import (
    SourceResult,
    kind_of,
    part_source_id,
    prepare_source,
    record_line,
    unknown_roles_hint,
)
from pipeline.steps.records import position_id, tokenized_schema

PROMPTS = "prompts.jsonl"
NATIVE = "native.jsonl"
NATIVE_TOKENIZED = "native_tokenized.parquet"
OUTPUTS = [PROMPTS, NATIVE, NATIVE_TOKENIZED]
PARTS_DIR = ".parts"
SCHEMA_PROBE_ROWS = 100

console = Console(stderr=True)
if not console.is_terminal:  # logs: wide enough that the counts table keeps one line per source
    console.width = max(console.width, 150)


def plan_slices(catalog: Catalog, workers: int) -> dict[str, int]:
    """Slices per source: one each, and the workers left over go, in turn, to the sources without a
    quota (a quota is the first N records, which only one reader in order can take)."""
    slices = {source.name: 1 for source in catalog.sources}
    open_ended = [source.name for source in catalog.sources if source.quota is None]
    for spare in range(max(0, workers - len(catalog.sources)) if open_ended else 0):
        slices[open_ended[spare % len(open_ended)]] += 1
    return slices


def run_sources(
    catalog: Catalog, parts: Path, offline: bool, workers: int, slices: dict[str, int], probe_rows: int
) -> list[SourceResult]:
    """Prepare every source (every slice of one) in worker processes; results in catalog order."""
    tasks = [
        (source, index, count)
        for source in catalog.sources
        for count in [slices[source.name]]
        for index in range(count)
    ]
    # spawn: a fresh interpreter per worker, no inherited pyarrow thread pools or locks.
    context = multiprocessing.get_context("spawn")
    pieces: dict[tuple[str, int], SourceResult] = {}
    progress = Progress(
        TextColumn("prep"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_setup)
    with progress, pool:
        task = progress.add_task("sources", total=len(tasks))
        futures = {
            pool.submit(
                prepare_source,
                source,
                source.location(catalog.base, offline),
                parts / (f"{source.name}.part" if count == 1 else f"{source.name}.{index}.part"),
                probe_rows,
                (index, count),
            ): (source, index)
            for source, index, count in tasks
        }
        for future in as_completed(futures):
            source, index = futures[future]
            try:
                result = future.result()
            except BrokenProcessPool:
                # a worker was killed (the OOM killer, a signal): every source in flight is lost
                result = SourceResult(source.name, source.format, source.native, kind_of(source))
                result.error = (
                    f"source {source.name!r}: its worker process died (killed by a signal, e.g. the OOM "
                    "killer); give the step more memory, or pass --workers 1 or a larger --worker-memory"
                )
            pieces[source.name, index] = result
            progress.update(task, advance=1, description=result.name)
    results = []
    for source in catalog.sources:
        result = pieces[source.name, 0]
        for index in range(1, slices[source.name]):
            result.absorb(pieces[source.name, index])
        results.append(result)
    return results


def _worker_setup() -> None:
    # datasets imports torch (seconds, hundreds of MiB) when it is installed, only to share
    # state with torch DataLoader workers; a prep worker never uses torch.
    os.environ["USE_TORCH"] = "0"


def _shuffle_key(seed: int, key: bytes) -> bytes:
    return hashlib.blake2b(f"{seed}:".encode() + key, digest_size=8).digest()


def _parts(results: list[SourceResult], kind: str) -> list[tuple[SourceResult, str, int]]:
    """``(result, part, rows read before it)`` of every part of one kind: a slice's row positions
    start after the rows of the source's slices before it."""
    out = []
    for result in results:
        if result.kind == kind:
            starts = itertools.accumulate(result.part_rows[:-1], initial=0)
            out += [(result, part, start) for part, start in zip(result.parts, starts, strict=True)]
    return out


def merge_jsonl(results: list[SourceResult], kind: str, out: Path, seed: int) -> int:
    """Dedup across sources, shuffle by a seeded hash, and write the records; returns the count.

    Only (shuffle key, file, offsets, rows before the file) entries are held in memory, not the
    records; the records are then copied out of the memory-mapped parts in shuffled order, each
    given its source_id on the way (a position in a slice becomes a position in the whole source).
    """
    seen: set[bytes] = set()
    index: list[tuple[bytes, int, int, int, int, int]] = []
    files = _parts(results, kind)
    for number, (result, part, start) in enumerate(files):
        with open(part, "rb") as fh:
            offset = 0
            for line in fh:
                tab = line.index(b"\t")
                key = line[:tab]
                tab2 = line.index(b"\t", tab + 1)
                if key in seen:
                    result.duplicates += 1
                    result.accepted -= 1
                else:
                    seen.add(key)
                    shuffle = _shuffle_key(seed, key)
                    at = offset + tab + 1, offset + tab2, offset + len(line)  # id, its end, line end
                    index.append((shuffle, number, *at, start))
                offset += len(line)
    index.sort()
    with contextlib.ExitStack() as stack:
        maps = [
            stack.enter_context(
                mmap.mmap(stack.enter_context(open(part, "rb")).fileno(), 0, access=mmap.ACCESS_READ)
            )
            if os.path.getsize(part)
            else b""
            for _, part, _ in files
        ]
        with atomic_path(out) as tmp, open(tmp, "wb") as dest:
            for _, number, id_at, tab, end, start in index:
                source_id = part_source_id(maps[number][id_at:tab], start)
                dest.write(record_line(source_id, maps[number][tab + 1 : end]))
    return len(index)


def merge_tokenized(results: list[SourceResult], out: Path) -> int:
    """Concatenate the pre-tokenized parts in catalog order, dropping cross-source duplicates."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    seen: set[str] = set()
    rows = 0
    schema = tokenized_schema()
    with atomic_path(out) as tmp:
        writer = pq.ParquetWriter(str(tmp), schema)
        try:
            for result, part, start in _parts(results, "tokenized"):
                for batch in pq.ParquetFile(part).iter_batches():
                    keys = batch.column("key").to_pylist()
                    keep = []
                    for i, key in enumerate(keys):
                        if key in seen:
                            result.duplicates += 1
                            result.accepted -= 1
                        else:
                            seen.add(key)
                            keep.append(i)
                    if not keep:
                        continue
                    table = batch.take(keep)
                    if start:
                        source_ids = [
                            source_id if position is None else position_id(start + position)
                            for source_id, position in zip(
                                table.column("source_id").to_pylist(),
                                table.column("position").to_pylist(),
                                strict=True,
                            )
                        ]
                        column = table.schema.get_field_index("source_id")
                        table = table.set_column(column, "source_id", pa.array(source_ids, pa.string()))
                    writer.write_batch(table.select(schema.names))
                    rows += len(keep)
        finally:
            writer.close()
    return rows


def counts_table(results: list[SourceResult]) -> Table:
    table = Table(title="prep: per-source counts", title_justify="left")
    for column in ("source", "adapter", "kind", "read", "accepted", "duplicates", "rejected", "status"):
        justify = "right" if column in ("read", "accepted", "duplicates") else "left"
        table.add_column(column, justify=justify, overflow="fold")
    for r in results:
        rejected = ", ".join(
            f"{k} {v}" + (f" ({', '.join(sorted(r.unknown_roles))})" if k == "unknown_role" else "")
            for k, v in sorted(r.rejected.items())
        )
        status = "[red]failed[/]" if r.error else ("[red]0 accepted[/]" if not r.accepted else "ok")
        counts = (str(r.read), str(r.accepted), str(r.duplicates))
        table.add_row(r.name, r.adapter, r.kind, *counts, rejected or "-", status)
    return table


def unreachable_hub(hub_sources: list[str]) -> str | None:
    """Why the sources read from the Hugging Face hub cannot be, when its name does not resolve
    from this host (the hub's client would retry each file for minutes); None when it resolves."""
    if not hub_sources or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return None
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except (socket.gaierror, UnicodeError):
        more = len(hub_sources) - 3
        named = ", ".join(hub_sources[:3]) + (f" and {more} more" if more > 0 else "")
        return (
            f"the Hugging Face hub ({host}) does not resolve from this host, and {named} read from it; "
            "run `eyrie prep --offline` to read each source's local sample instead, or fix the network "
            "(HF_ENDPOINT names a mirror)"
        )
    return None


@settings_keywords(PrepConfig)
def run_prep(
    catalog_path: Path | None,
    out_dir: Path | None = None,
    *,
    settings: PrepConfig,
    probe_rows: int = SCHEMA_PROBE_ROWS,
) -> int:
    """Run the step with ``settings`` (or its fields, as keywords); returns the exit code: 0 done;
    2 bad input (the catalog, its options or a source's data); 1 failed otherwise (a reader or the
    hub, a worker killed). Every output is complete before the manifest is written."""
    offline = settings.offline
    try:
        catalog, hub_sources, memory_per_worker = _checked_inputs(
            catalog_path, settings.quota, offline, settings.worker_memory
        )
    except (CatalogError, ValueError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_BAD_INPUT
    unreachable = None if offline else unreachable_hub(hub_sources)
    if unreachable:
        console.print(f"[red]error:[/] {escape(unreachable)}", soft_wrap=True)
        return 1
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    seed = catalog.seed if settings.seed is None else settings.seed
    step_dir = Path(out_dir) if out_dir else step_dir_from_env()
    parts = _empty_parts_dir(step_dir)
    count, slices, facts = _plan_parallel(catalog, memory_per_worker, settings.workers)
    results = run_sources(catalog, parts, offline, count, slices, probe_rows)

    failed = [r for r in results if r.error or not r.accepted]
    if failed:
        shutil.rmtree(parts, ignore_errors=True)
        return _report_failed(results, failed)

    records = {
        PROMPTS: merge_jsonl(results, "prompts", step_dir / PROMPTS, seed),
        NATIVE: merge_jsonl(results, "native", step_dir / NATIVE, seed),
        NATIVE_TOKENIZED: merge_tokenized(results, step_dir / NATIVE_TOKENIZED),
    }
    shutil.rmtree(parts, ignore_errors=True)
    _report_done(catalog, results)
    write_manifest(
        step_dir,
        OUTPUTS,
        records=records,
        stats={
            "seed": seed,
            "offline": offline,
            "parallel": facts,
            "sources": {r.name: r.as_stats() for r in results},
        },
    )
    console.print(
        f"prep: {records[PROMPTS]} prompts, {records[NATIVE]} native conversations, "
        f"{records[NATIVE_TOKENIZED]} native tokenized rows -> {step_dir}"
    )
    return 0


def _checked_inputs(
    catalog_path: Path | None, quota: int | None, offline: bool, worker_memory: str
) -> tuple[Catalog, list[str], int]:
    """The catalog (capped at ``quota``), the names of its sources read from the hub, and the memory
    per worker; raises CatalogError or ValueError before any work starts."""
    catalog = load_catalog(catalog_path)
    if quota is not None:
        catalog = catalog.capped(quota)
    # Resolve every location up front: fail before any work.
    locations = {source.name: source.location(catalog.base, offline) for source in catalog.sources}
    try:
        memory_per_worker = parse_size(worker_memory)
    except ValueError as exc:
        raise ValueError(f"--worker-memory: {exc}") from None
    hub_sources = [name for name, where in locations.items() if not Path(where).is_absolute()]
    return catalog, hub_sources, memory_per_worker


def _empty_parts_dir(step_dir: Path) -> Path:
    """The step dir, its manifest gone, with an empty folder for the sources' parts."""
    step_dir.mkdir(parents=True, exist_ok=True)
    invalidate_manifest(step_dir)
    parts = step_dir / PARTS_DIR
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    return parts


def _plan_parallel(
    catalog: Catalog, memory_per_worker: int, workers: int | None
) -> tuple[int, dict[str, int], dict]:
    """How many workers, each source's slices, and the facts they were planned from (said, and kept
    for the manifest)."""
    # A source without a quota can be read in slices by any number of workers.
    open_ended = any(source.quota is None for source in catalog.sources)
    count, facts = plan_workers(
        sys.maxsize if open_ended else len(catalog.sources), memory_per_worker, workers
    )
    slices = plan_slices(catalog, count)
    facts["slices"] = {name: n for name, n in slices.items() if n > 1}
    sliced = "".join(f", {name} in {n} slices" for name, n in facts["slices"].items())
    console.print(
        f"prep: {len(catalog.sources)} sources, {count} at a time{sliced} "
        f"(budget {format_size(facts['budget_available'])} from {facts['budget_binding']}, "
        f"{format_size(memory_per_worker)} per worker, {facts['cpus']} CPUs)",
        markup=False,
    )
    return count, slices, facts


def _report_failed(results: list[SourceResult], failed: list[SourceResult]) -> int:
    """Say why each failed source failed; returns the step's exit code."""
    console.print(counts_table(results))
    for r in failed:
        reason = r.error or f"source {r.name!r}: 0 records accepted out of {r.read} read"
        console.print(f"[red]error:[/] {escape(reason)}", soft_wrap=True)
    console.print(f"[red]prep failed:[/] {len(failed)} of {len(results)} sources; no output written")
    # Bad input (2) when every failed source is the catalog's or its data's to fix.
    return 1 if any(r.error and not r.bad_input for r in failed) else 2


def _report_done(catalog: Catalog, results: list[SourceResult]) -> None:
    """The counts, and a warning for each source that lost rows to roles it does not map or to a
    file cut short."""
    console.print(counts_table(results))
    for source, r in zip(catalog.sources, results, strict=True):  # results are in catalog order
        for cut in r.cut_short:
            console.print(f"[yellow]warning:[/] source {r.name!r}: {escape(cut)}", soft_wrap=True)
        if r.unknown_roles:
            lost, hint = sum(r.unknown_roles.values()), unknown_roles_hint(source, r.unknown_roles)
            console.print(f"[yellow]warning:[/] source {r.name!r}: {lost} rows rejected: {escape(hint)}")
