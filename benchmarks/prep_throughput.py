"""Throughput of prep + tokenize against a raw fast-tokenizer pass over the same text (goal >= 0.8x).

Workload: the sample conversations of the default catalog, repeated (each copy made
unique so dedup keeps it) into one local source in the ``messages`` shape, read as
native conversations; a parquet file by default, as the hub serves these datasets
(``--format jsonl`` for the slower JSON reader of HF datasets). The samples are short
(~180 tokens per conversation), so per-conversation costs weigh heavily;
``--lengthen N`` writes every message's text N times over (paragraphs) for
conversations of the length generated data has. Measured end to end:

- ours: ``prep`` (worker processes, HF datasets streaming, adapter, dedup, shuffle,
  manifest) then ``tokenize`` (template, one tokenization, loss mask, parquet shards,
  manifest), each with its default workers;
- raw: ``encode_batch`` over the very texts the template renders, in the same batches,
  reading the ids back (rendering is not timed): what ``tokenizer(texts)`` does, on
  every core. Also shown: ``encode_batch_fast`` (no character offsets), the fastest a
  tokenizer alone can go.

Runs alternate (raw, ours, raw, ours, ...) so both see the same machine load; the ratio
is raw seconds / our seconds (throughput ratio), median over the repeats.

    .venv/bin/python -m benchmarks.prep_throughput --copies 40 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.prep_common import TEMPLATES, median, sample_conversations, tokenizers


def write_workload(path: Path, copies: int, lengthen: int = 1) -> int:
    """The workload as parquet (how the hub serves these datasets) or as .jsonl, by ``path``'s suffix."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, conversations = [], sample_conversations()
    for copy in range(copies):
        for record in conversations:
            messages = json.loads(json.dumps(record["conversations"]))
            for message in messages:
                for key in ("content", "reasoning_content"):
                    if isinstance(message.get(key), str) and message[key]:
                        message[key] = "\n\n".join([message[key]] * lengthen)
            first_user = next(m for m in messages if m["role"] == "user")
            first_user["content"] += f" (copy {copy})"
            rows.append({"messages": messages, "tools": record.get("tools")})
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1024)
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def raw_pass(folder: Path, template: str, native: Path, method: str) -> tuple[float, int, int]:
    from pipeline.steps.tokenize.chat_template import render
    from pipeline.steps.tokenize.rows import parse_conversation, read_lines
    from pipeline.steps.tokenize.run import BATCH
    from pipeline.steps.tokenize.tokenizer import Tokenizer

    encoder = Tokenizer(folder, template)
    texts = [
        render(encoder.template, c.messages, c.tools, special=encoder.special)[0]
        for c in map(parse_conversation, read_lines(native))
    ]
    encode = getattr(encoder.backend, method)
    started = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), BATCH):
        for encoding in encode(texts[i : i + BATCH], add_special_tokens=False):
            tokens += len(encoding.ids)
    return time.perf_counter() - started, tokens, len(texts)


def ours(catalog: Path, folder: Path, template: str, work: Path, workers: int | None) -> tuple[float, Path]:
    from pipeline.steps.prep.run import run_prep
    from pipeline.steps.tokenize.run import run_tokenize

    prep_dir, tok_dir = work / "prep", work / "tokenize"
    started = time.perf_counter()
    assert run_prep(catalog, prep_dir) == 0
    assert (
        run_tokenize(
            folder,
            [prep_dir / "native.jsonl"],
            [],
            tok_dir,
            chat_template=template,
            max_length=1 << 20,
            workers=workers,
        )
        == 0
    )
    return time.perf_counter() - started, prep_dir / "native.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=40, help="copies of the sample conversations")
    parser.add_argument("--lengthen", type=int, default=1, help="write every message's text N times over")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=TEMPLATES)
    parser.add_argument("--format", default="parquet", choices=["parquet", "jsonl"], help="workload file")
    parser.add_argument("--workers", type=int, default=None, help="tokenize workers (default: the step's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folders = tokenizers(work)
        source = work / f"conversations.{args.format}"
        count = write_workload(source, args.copies, args.lengthen)
        catalog = work / "catalog.yaml"
        catalog.write_text(
            yaml.safe_dump(
                {"sources": [{"name": "bench", "data": str(source), "format": "messages", "native": True}]}
            )
        )
        print(
            f"workload: {count} conversations, {source.stat().st_size / 2**20:.1f} MiB, cpus={os.cpu_count()}"
        )
        print(
            "| template (mask method) | tokens | tokens/conversation | raw encode_batch "
            "| raw encode_batch_fast | prep + tokenize | ratio | ratio vs fast |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for template in args.templates:
            raw_times, fast_times, our_times, tokens, conversations = [], [], [], 0, 0
            for repeat in range(args.repeats):
                seconds, native = ours(
                    catalog, *folders[template], work / f"{template}-{repeat}", args.workers
                )
                our_times.append(seconds)
                raw_seconds, tokens, conversations = raw_pass(*folders[template], native, "encode_batch")
                raw_times.append(raw_seconds)
                fast_times.append(raw_pass(*folders[template], native, "encode_batch_fast")[0])
            raw, fast, our = median(raw_times), median(fast_times), median(our_times)
            method = "message probes" if template == "unmarked" else "generation markers"
            print(
                f"| {template} ({method}) | {tokens} | {tokens / conversations:.0f} "
                f"| {raw:.2f} s ({tokens / raw / 1e3:.0f}k tok/s) | {fast:.2f} s "
                f"| {our:.2f} s ({tokens / our / 1e3:.0f}k tok/s) | {raw / our:.2f}x | {fast / our:.2f}x |"
            )


if __name__ == "__main__":
    main()
