"""``eyrie prep``: a catalog of sources in, ``prompts.jsonl`` + native conversations + native tokens out.

Sources run in parallel worker processes, as many as the step's memory budget
holds (``memory_budget().available // --worker-memory``, at most one per CPU).
Each writes its own part; the merge then dedups across sources (first source
in catalog order wins), shuffles deterministically with the seed, and writes
the outputs atomically. A failed source, or one with 0 accepted records, fails
the step with the per-source table, and no output is written.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.memory.budget import memory_budget
from pipeline.memory.units import format_size, parse_size
from pipeline.run.manifest import atomic_path, step_dir_from_env, write_manifest
from pipeline.steps.prep.catalog import Catalog, CatalogError, load_catalog
from pipeline.steps.prep.sources import SourceResult, kind_of, prepare_source, tokenized_schema

PROMPTS = "prompts.jsonl"
NATIVE = "native.jsonl"
NATIVE_TOKENIZED = "native_tokenized.parquet"
OUTPUTS = [PROMPTS, NATIVE, NATIVE_TOKENIZED]
PARTS_DIR = ".parts"
DEFAULT_WORKER_MEMORY = "512MiB"
SCHEMA_PROBE_ROWS = 100

console = Console(stderr=True)
if not console.is_terminal:  # logs: wide enough that the counts table keeps one line per source
    console.width = max(console.width, 150)


def plan_workers(tasks: int, worker_memory: int, requested: int | None) -> tuple[int, dict]:
    """How many worker processes run at once: what the memory budget holds, at most one per CPU
    (and per task)."""
    budget = memory_budget()
    by_memory = max(1, budget.available // worker_memory)
    cpus = len(os.sched_getaffinity(0))
    workers = max(1, min(tasks, cpus, by_memory, requested or tasks))
    facts = {
        "workers": workers,
        "worker_memory": worker_memory,
        "budget_available": budget.available,
        "budget_binding": budget.binding,
        "cpus": cpus,
    }
    return workers, facts


def run_sources(
    catalog: Catalog, parts: Path, offline: bool, workers: int, probe_rows: int
) -> list[SourceResult]:
    """Prepare every source in worker processes; results in catalog order."""
    locations = {}
    for source in catalog.sources:
        locations[source.name] = source.location(catalog.base, offline)
    # spawn: a fresh interpreter per worker, no inherited pyarrow thread pools or locks.
    context = multiprocessing.get_context("spawn")
    results: dict[str, SourceResult] = {}
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
        task = progress.add_task("sources", total=len(catalog.sources))
        futures = {
            pool.submit(
                prepare_source,
                source,
                locations[source.name],
                parts / f"{source.name}.part",
                probe_rows,
            ): source
            for source in catalog.sources
        }
        for future in as_completed(futures):
            source = futures[future]
            try:
                result = future.result()
            except BrokenProcessPool:
                # a worker was killed (the OOM killer, a signal): every source in flight is lost
                result = SourceResult(source.name, source.format, source.native, kind_of(source))
                result.error = (
                    f"source {source.name!r}: its worker process died (killed by a signal, e.g. the OOM "
                    "killer); give the step more memory, or pass --workers 1 or a larger --worker-memory"
                )
            results[result.name] = result
            progress.update(task, advance=1, description=result.name)
    return [results[s.name] for s in catalog.sources]


def _worker_setup() -> None:
    # datasets imports torch (seconds, hundreds of MiB) when it is installed, only to share
    # state with torch DataLoader workers; a prep worker never uses torch.
    os.environ["USE_TORCH"] = "0"


def _shuffle_key(seed: int, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()


def merge_jsonl(results: list[SourceResult], kind: str, out: Path, seed: int) -> int:
    """Dedup across sources, shuffle by a seeded hash, and write the records; returns the count.

    Only (shuffle key, file, offset) triples are held in memory, not the records.
    """
    seen: set[str] = set()
    index: list[tuple[bytes, int, int]] = []
    files = [r for r in results if r.kind == kind]
    for number, result in enumerate(files):
        with open(result.part, "rb") as fh:
            offset = 0
            for line in fh:
                key = line[: line.index(b"\t")].decode()
                if key in seen:
                    result.duplicates += 1
                    result.accepted -= 1
                else:
                    seen.add(key)
                    index.append((_shuffle_key(seed, key), number, offset))
                offset += len(line)
    index.sort()
    handles = [open(r.part, "rb") for r in files]
    try:
        with atomic_path(out) as tmp, open(tmp, "wb") as dest:
            for _, number, offset in index:
                handle = handles[number]
                handle.seek(offset)
                line = handle.readline()
                dest.write(line[line.index(b"\t") + 1 :])
    finally:
        for handle in handles:
            handle.close()
    return len(index)


def merge_tokenized(results: list[SourceResult], out: Path) -> int:
    """Concatenate the pre-tokenized parts in catalog order, dropping cross-source duplicates."""
    import pyarrow.parquet as pq

    seen: set[str] = set()
    rows = 0
    schema = tokenized_schema()
    with atomic_path(out) as tmp:
        writer = pq.ParquetWriter(str(tmp), schema)
        try:
            for result in (r for r in results if r.kind == "tokenized"):
                for batch in pq.ParquetFile(result.part).iter_batches():
                    keys = batch.column("key").to_pylist()
                    keep = []
                    for i, key in enumerate(keys):
                        if key in seen:
                            result.duplicates += 1
                            result.accepted -= 1
                        else:
                            seen.add(key)
                            keep.append(i)
                    if keep:
                        table = batch.take(keep).select(schema.names)
                        writer.write_batch(table)
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
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r.rejected.items())) or "-"
        status = "[red]failed[/]" if r.error else ("[red]0 accepted[/]" if not r.accepted else "ok")
        table.add_row(
            r.name, r.adapter, r.kind, str(r.read), str(r.accepted), str(r.duplicates), rejected, status
        )
    return table


def prep(
    catalog_path: Path | None,
    out_dir: Path | None = None,
    *,
    offline: bool = False,
    seed: int | None = None,
    workers: int | None = None,
    worker_memory: str = DEFAULT_WORKER_MEMORY,
    probe_rows: int = SCHEMA_PROBE_ROWS,
) -> int:
    """Run the step; returns the exit code. Every output is complete before the manifest is written."""
    try:
        catalog = load_catalog(catalog_path)
        for source in catalog.sources:  # resolve every location up front: fail before any work
            source.location(catalog.base, offline)
        try:
            memory_per_worker = parse_size(worker_memory)
        except ValueError as exc:
            raise ValueError(f"--worker-memory: {exc}") from None
    except (CatalogError, ValueError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return 2
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    seed = catalog.seed if seed is None else seed
    step_dir = Path(out_dir) if out_dir else step_dir_from_env()
    step_dir.mkdir(parents=True, exist_ok=True)
    parts = step_dir / PARTS_DIR
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()

    count, facts = plan_workers(len(catalog.sources), memory_per_worker, workers)
    console.print(
        f"prep: {len(catalog.sources)} sources, {count} at a time "
        f"(budget {format_size(facts['budget_available'])} from {facts['budget_binding']}, "
        f"{format_size(memory_per_worker)} per worker, {facts['cpus']} CPUs)"
    )
    results = run_sources(catalog, parts, offline, count, probe_rows)

    failed = [r for r in results if r.error or not r.accepted]
    if failed:
        console.print(counts_table(results))
        for r in failed:
            reason = r.error or f"source {r.name!r}: 0 records accepted out of {r.read} read"
            console.print(f"[red]error:[/] {escape(reason)}", soft_wrap=True)
        shutil.rmtree(parts, ignore_errors=True)
        console.print(f"[red]prep failed:[/] {len(failed)} of {len(results)} sources; no output written")
        return 1

    records = {
        PROMPTS: merge_jsonl(results, "prompts", step_dir / PROMPTS, seed),
        NATIVE: merge_jsonl(results, "native", step_dir / NATIVE, seed),
        NATIVE_TOKENIZED: merge_tokenized(results, step_dir / NATIVE_TOKENIZED),
    }
    shutil.rmtree(parts, ignore_errors=True)
    console.print(counts_table(results))
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
