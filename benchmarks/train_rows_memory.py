"""Training rows in memory: Python lists (the loader eyrie had before) against the memory-mapped rows file.

The data: one parquet shard of ``--tokens`` tokens in the tokenize step's types (int32 ids, int8 loss
mask), rows of 200-2,000 tokens, ids drawn from Kimi-K2.5's vocabulary (163,840), the first tenth of
each row the prompt. Each way runs in fresh processes (``--ranks`` of them at once, as torchrun's
ranks on one node would), side by side and alternating, ``--repeats`` times; each process imports
the same modules, then loads the rows and builds every batch of one epoch (``--batch-size`` rows).

What a process reads from ``/proc``:
- its anonymous resident memory (``RssAnon``: private to it) before loading, after loading and
  after the epoch;
- the resident pages of the rows file it maps, and its proportional share of them (``Pss``: pages
  that several processes map are divided among them), read while every rank still holds its rows;
- its peak resident memory (``ru_maxrss``) above what it held before loading.

"mapped (converts)" is the first run on a shard: the process writes the rows file, then maps it.

    .venv/bin/python -m benchmarks.train_rows_memory [--tokens 1000000] [--ranks 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 163840
WARM_TOKENS = 5000
MAX_LENGTH = 4096
WAYS = ("lists", "mapped (converts)", "mapped")


def write_shard(folder: Path, tokens: int) -> Path:
    """A folder with one shard of ``tokens`` tokens."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(200, 2001)))
    lengths[-1] -= sum(lengths) - tokens
    ids = [rng.integers(2, VOCAB, n, dtype=np.int32) for n in lengths]
    masks = [np.r_[np.zeros(n // 10, np.int8), np.ones(n - n // 10, np.int8)] for n in lengths]
    table = pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
            "source": pa.array(["benchmark"] * len(lengths)),
        }
    )
    shards = folder / f"shards-{tokens}"
    shards.mkdir(parents=True)
    pq.write_table(table, shards / "shard-00000.parquet")
    return shards


def load_as_python_lists(path: Path, max_length: int):
    """The loader before the rows were memory-mapped: every row's tokens as Python lists."""
    import pyarrow.parquet as pq

    from pipeline.steps.shards import Example

    rows = []
    for file in sorted(path.rglob("*.parquet")):
        table = pq.read_table(file)
        ids = table.column("input_ids").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        sources = table.column("source").to_pylist()
        for i, m, s in zip(ids, masks, sources, strict=True):
            if sum(m[:max_length]) > 0 and len(i) >= 3:
                rows.append(Example(i[:max_length], m[:max_length], s or ""))
    return rows


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def _mapping(path: Path) -> dict[str, int]:
    """Rss and Pss of this process's mappings of ``path`` (zero when it maps none)."""
    sizes = {"Rss": 0, "Pss": 0}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and first[:-1] in sizes:
            sizes[first[:-1]] += int(line.split()[1]) * 1024
    return sizes


def _load(way: str, shards: Path, mapped: Path):
    from pipeline.steps.shards import load_shards

    if way == "lists":
        return load_as_python_lists(shards, MAX_LENGTH)
    return load_shards(shards, MAX_LENGTH, mapped)


def child(way: str, shards: Path, mapped: Path, batch_size: int) -> None:
    """One rank: load, build an epoch of batches, report; then hold the rows until stdin closes."""
    import pipeline.steps.train.loop  # noqa: F401  (what a training process imports)
    from pipeline.steps.train.data import batch_at, collate, steps_per_epoch

    # The same way over a small shard first: what the first use of a module or an allocator costs
    # is not the rows' memory.
    warm = shards.parent / f"shards-{WARM_TOKENS}"
    _load(way, warm, mapped.with_name(f"warm-{os.getpid()}.arrow" if "converts" in way else "warm.arrow"))
    before = _status()
    started = time.monotonic()
    rows = _load(way, shards, mapped)
    load_s = time.monotonic() - started
    loaded = _status()
    started = time.monotonic()
    for step in range(steps_per_epoch(len(rows), batch_size, 1)):
        collate(batch_at(rows, step, batch_size, 0, 0, 1), 0)
    epoch_s = time.monotonic() - started
    after = _status()
    report = {
        "rows": len(rows),
        "load_s": load_s,
        "epoch_s": epoch_s,
        "anon_loaded": loaded["RssAnon"] - before["RssAnon"],
        "anon_epoch": after["RssAnon"] - before["RssAnon"],
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before["VmRSS"],
    }
    print(json.dumps(report), flush=True)
    sys.stdin.readline()  # every rank now holds its rows: the file's pages are shared as they will be
    print(json.dumps(_mapping(mapped)), flush=True)
    sys.stdin.readline()


def run_ranks(way: str, shards: Path, mapped: Path, ranks: int, batch_size: int) -> dict[str, float]:
    """``ranks`` processes of one way at once; their reports, summed over the ranks (times: the mean)."""
    if way == "mapped (converts)":
        mapped.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks.train_rows_memory", "--child", way, str(shards), str(mapped)]
    procs = [
        subprocess.Popen([*argv, str(batch_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(ranks)
    ]
    reports = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
    for p, report in zip(procs, reports, strict=True):
        report.update({f"file_{k.lower()}": v for k, v in json.loads(p.stdout.readline()).items()})
        p.stdin.close()
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a {way} process exited with {p.returncode}")
    total = {k: sum(r[k] for r in reports) for k in reports[0]}
    for k in ("load_s", "epoch_s", "rows"):
        total[k] /= ranks
    return total


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        way, shards, mapped, batch_size = sys.argv[2:6]
        child(way, Path(shards), Path(mapped), int(batch_size))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    from pipeline.steps.shards import load_shards

    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shard(Path(tmp), args.tokens)
        mapped = Path(tmp) / "rows" / "rows.arrow"
        load_shards(write_shard(Path(tmp), WARM_TOKENS), MAX_LENGTH, mapped.with_name("warm.arrow"))
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way in WAYS:  # alternating: the machine's load falls on every way alike
                runs[way].append(run_ranks(way, shards, mapped, args.ranks, args.batch_size))
        file_bytes = mapped.stat().st_size
    mib = 1024**2
    print(
        f"{args.tokens:,} tokens, {runs['mapped'][0]['rows']:.0f} rows, {args.ranks} rank(s), batch "
        f"{args.batch_size}, median of {args.repeats}; rows file {file_bytes / mib:.2f} MiB "
        f"({file_bytes / args.tokens:.2f} bytes a token)\n"
    )
    print(
        "| way | anonymous, loaded | anonymous, after an epoch | rows file resident (Pss) "
        "| in all, bytes a token | peak above the start | load | epoch of batches |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for way, results in runs.items():
        m = {k: statistics.median(r[k] for r in results) for k in results[0]}
        held = m["anon_epoch"] + m["file_pss"]
        print(
            f"| {way} | {m['anon_loaded'] / mib:.1f} MiB | {m['anon_epoch'] / mib:.1f} MiB "
            f"| {m['file_rss'] / mib:.1f} MiB ({m['file_pss'] / mib:.1f} MiB) | {held / args.tokens:.1f} "
            f"| {m['peak'] / mib:.1f} MiB | {m['load_s']:.2f} s | {m['epoch_s']:.2f} s |"
        )
        print(json.dumps({"way": way, "ranks": args.ranks, **m}), file=sys.stderr)


if __name__ == "__main__":
    main()
