"""``eyrie tokenize``: conversations in, parquet shards out.

A shard row is ``input_ids``, ``loss_mask``, ``source``, ``id`` (the conversation's, as in
conversations.jsonl and prompts.jsonl) and ``source_id`` (its row in the dataset, as prep
found it), so every training row traces back to its conversation and its dataset row.

The loss mask marks what the assistant produces and nothing else, from ONE rendering and ONE
tokenization per conversation (``loss_mask.py``); the chat template renders it
(``chat_template.py``), the target's tokenizer tokenizes it (``tokenizer.py``: a tiktoken-based
slow tokenizer, Kimi-K2.5's, is converted to a fast one once and cached, ``fast.py``, then
checked token for token against it on the step's first conversations before anything is
written), and the shards are written beside their reader (``shards.py``).

Rendering is Python (Jinja), tokenizing is Rust: batches of conversations go to
forked worker processes that render, tokenize and mask them, as many as the
step's memory budget and CPUs allow; the main process keeps the order, counts
and writes the shards.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.contract.atomic import atomic_path
from pipeline.contract.exits import EXIT_BAD_INPUT, EXIT_FAILED
from pipeline.contract.step import invalidate_manifest, step_dir_from_env, write_manifest
from pipeline.memory import parse_size, plan_workers
from pipeline.steps.options import settings_keywords
from pipeline.steps.records import position_id, record_id, tokens_key
from pipeline.steps.tokenize.chat_template import ChatTemplate, TokenizeError
from pipeline.steps.tokenize.config import TokenizeConfig
from pipeline.steps.tokenize.rows import Counts, InputError, Line, Record, Rows, read_lines
from pipeline.steps.tokenize.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pipeline.steps.shards import ShardWriter

SHARDS = "shards"
BATCH = 256
CHECKED_CONVERSATIONS = 256
"""A converted tokenizer is checked against the target's own on this many conversations of each
file before any is tokenized: one batch, enough for a split pattern that differs to show (contractions,
digits and whitespace runs are in nearly every conversation), and a few seconds of the slow
tokenizer at most, where checking every row would cost more than tokenizing it."""

console = Console(stderr=True)
if not console.is_terminal:  # logs: wide enough that the counts table keeps one line per source
    console.width = max(console.width, 150)


_worker_tokenizer: Tokenizer | None = None
"""Set before the worker pool forks: every worker inherits the loaded tokenizer and template."""


def _worker_setup() -> None:
    # Each worker tokenizes one batch at a time on one core; Rust threads in every worker would
    # oversubscribe the CPUs the workers already share out.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_in_worker(lines: list[Line], max_length: int) -> tuple[Any, dict[str, Counts]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_lines(lines, max_length)


class Encoders:
    """Batches of lines to results, in order: in this process, or in forked workers.

    The workers are forked before anything else starts a thread here (the progress bar,
    the tokenizer's Rust threads), and at most ``2 × workers`` batches are in flight, so
    memory stays flat however long the input is.
    """

    def __init__(self, tokenizer: Tokenizer, workers: int):
        global _worker_tokenizer
        self.tokenizer = tokenizer
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1:
            _worker_tokenizer = tokenizer
            self.pool = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_setup
            )
            self.pool.submit(int).result()  # fork every worker now

    def map(self, batches: Iterable[list[Line]], max_length: int) -> Iterator[tuple[Any, dict[str, Counts]]]:
        if self.pool is None:
            yield from (self.tokenizer.encode_lines(batch, max_length) for batch in batches)
            return
        pending: deque[Future] = deque()
        try:
            for batch in batches:
                pending.append(self.pool.submit(_encode_in_worker, batch, max_length))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise TokenizeError(
                "a tokenize worker process died (killed by a signal, e.g. the OOM killer); give the step "
                "more memory, or pass --workers 1 or a larger --worker-memory"
            ) from None

    def __enter__(self) -> Encoders:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@settings_keywords(TokenizeConfig)
def run_tokenize(
    target: str,
    conversations: list[Path],
    tokenized: list[Path],
    out_dir: Path | None = None,
    *,
    settings: TokenizeConfig,
    trust_remote_code: bool = False,
) -> int:
    """Run the step with ``settings`` (or its fields, as keywords); returns the exit code.
    ``target``: a model folder or a hub id."""
    max_length = settings.max_length
    try:
        per_worker = _checked_inputs(conversations, tokenized, settings.worker_memory)
        encoder = Tokenizer(target, settings.chat_template, trust_remote_code)
        checked = encoder.check_against_own(
            line for path in conversations for line in islice(read_lines(path), CHECKED_CONVERSATIONS)
        )
    except TokenizeError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_BAD_INPUT
    worker_count, worker_facts = plan_workers(len(os.sched_getaffinity(0)), per_worker, settings.workers)
    encoders = Encoders(encoder, worker_count)
    step_dir = Path(out_dir) if out_dir else step_dir_from_env()
    invalidate_manifest(step_dir)
    _say_how_it_tokenizes(encoder, checked)
    per_source: dict[str, Counts] = {}
    progress = Progress(
        TextColumn("tokenize"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    try:
        with encoders, progress:
            tables = _tables(encoders, conversations, tokenized, max_length, progress)
            writer = _write_shards(tables, step_dir / SHARDS, settings.shard_rows, per_source)
    except TokenizeError as exc:
        _print_counts(per_source)
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_BAD_INPUT if isinstance(exc, InputError) else EXIT_FAILED
    _print_counts(per_source)
    totals = Counts()
    for entry in per_source.values():
        totals.add(entry)
    tokenizer_stats = {"converted": str(encoder.converted), "checked_conversations": checked}
    write_manifest(
        step_dir,
        [SHARDS],
        records={SHARDS: writer.rows},
        stats={
            "chat_template": encoder.template.name,
            "mask_method": _mask_method(encoder.template, totals),
            **({"tokenizer": tokenizer_stats} if encoder.converted is not None else {}),
            "max_length": max_length,
            "shards": writer.shards,
            "workers": worker_facts,
            "totals": totals.as_stats(),
            "sources": {name: c.as_stats() for name, c in sorted(per_source.items())},
        },
    )
    console.print(
        f"tokenize: {writer.rows} rows, {totals.tokens} tokens ({totals.assistant_tokens} assistant), "
        f"{totals.truncated} truncated ({totals.assistant_tokens_truncated} assistant tokens cut), "
        f"{writer.shards} shard(s) -> {step_dir / SHARDS}"
    )
    return 0


def _checked_inputs(conversations: list[Path], tokenized: list[Path], worker_memory: str) -> int:
    """The memory per worker; raises TokenizeError for a bad ``--worker-memory`` or input file list."""
    try:
        per_worker = parse_size(worker_memory)
    except ValueError as exc:
        raise TokenizeError(f"--worker-memory: {exc}") from None
    missing = [str(p) for p in [*conversations, *tokenized] if not Path(p).is_file()]
    if missing:
        raise TokenizeError(f"input file(s) {', '.join(missing)} do not exist; run the steps that make them")
    if not conversations and not tokenized:
        raise TokenizeError("nothing to tokenize: pass --conversations and/or --tokenized files")
    return per_worker


def _say_how_it_tokenizes(encoder: Tokenizer, checked: int) -> None:
    """What is not the plain case: a converted tokenizer, spans found without generation markers."""
    if encoder.converted is not None:
        console.print(
            f"tokenize: the target's tiktoken tokenizer as a fast one ({encoder.converted}), the same "
            f"tokens as its own on the first {checked} conversation(s)",
            markup=False,
        )
    if not encoder.template.markers:
        console.print(
            f"tokenize: chat template {encoder.template.name!r} has no {{% generation %}} markers; assistant "
            "spans come from each message rendered after the one before it, checked against the whole "
            "(a conversation that does not render so takes its rendered prefixes: the manifest counts them)",
            markup=False,
        )


def _tables(
    encoders: Encoders, conversations: list[Path], tokenized: list[Path], max_length: int, progress: Progress
) -> Iterator[tuple[Any, dict[str, Counts]]]:
    """The rows of every conversation file tokenized, then of every pre-tokenized file checked, as
    tables and their counts, in order."""
    task = progress.add_task("conversations", total=None)
    for path in conversations:
        progress.update(task, description=str(path.name))
        for table, counts in encoders.map(_batches(read_lines(path), BATCH), max_length):
            yield table, counts
            progress.advance(task, sum(c.conversations for c in counts.values()))
    for path in tokenized:
        progress.update(task, description=str(path.name))
        yield from _pass_through(path, encoders.tokenizer.vocab_size, max_length)


def _write_shards(
    tables: Iterable[tuple[Any, dict[str, Counts]]],
    shards: Path,
    shard_rows: int,
    per_source: dict[str, Counts],
) -> ShardWriter:
    """The tables into the ``shards`` folder, whole or not at all, their counts added to ``per_source``
    as they come; raises TokenizeError when no row is kept."""
    from pipeline.steps.shards import ShardWriter  # pyarrow and numpy: not for the command's --help

    with atomic_path(shards) as tmp:
        tmp.mkdir()
        writer = ShardWriter(tmp, shard_rows)
        try:
            for table, counts in tables:
                writer.write(table)
                for source, entry in counts.items():
                    per_source.setdefault(source, Counts()).add(entry)
        finally:
            writer.close()
        if writer.rows == 0:
            raise TokenizeError("no conversation produced a row with assistant tokens; see the counts")
    return writer


def _mask_method(template: ChatTemplate, totals: Counts) -> str:
    """The template's method, with ``prefix_render`` where some or all spans took it."""
    if not totals.prefix_rendered:
        return template.method
    return "prefix_render" if totals.prefix_rendered == totals.rows else f"{template.method}+prefix_render"


def _pass_through(path: Path, vocab_size: int, max_length: int) -> Iterator[tuple[Any, dict[str, Counts]]]:
    """Pre-tokenized rows (``input_ids``, ``loss_mask``, ``source``): checked, truncated, kept. A file
    without ``id`` and ``source_id`` (not written by prep) gives each row the id prep would, and
    its index in the file."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(str(path))
    traced = {"id", "source_id"} <= set(file.schema_arrow.names)
    columns = ["input_ids", "loss_mask", "source", *(["id", "source_id"] if traced else [])]
    position = 0
    for batch in file.iter_batches(columns=columns):
        rows = Rows(max_length)
        values = [batch.column(name).to_pylist() for name in columns]
        for ids, mask, source, *origin in zip(*values, strict=True):
            if not traced:
                content = tokens_key(ids, mask)
                origin = [record_id(source, content), position_id(position)]
            position += 1
            if ids and max(ids) >= vocab_size:
                rows.reject(source, "id_out_of_vocab")
            else:
                rows.keep(Record(source, *origin, [], None), ids, mask)
        yield rows.table(), rows.counts


def _print_counts(per_source: dict[str, Counts]) -> None:
    from rich.table import Table

    table = Table(title="tokenize: per-source counts", title_justify="left")
    for column in ("source", "conversations", "rows", "tokens", "assistant", "truncated", "rejected"):
        table.add_column(column, justify="left" if column in ("source", "rejected") else "right")
    for name, c in sorted(per_source.items()):
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(c.rejected.items())) or "-"
        table.add_row(
            name,
            str(c.conversations),
            str(c.rows),
            str(c.tokens),
            str(c.assistant_tokens),
            str(c.truncated),
            rejected,
        )
    console.print(table)
