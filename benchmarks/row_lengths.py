"""How long the bundled agentic samples are as training rows, and what a row limit keeps of them.

The agentic samples (``AGENTIC``: Kimi's reasoning and tool-call traces, SWE-agent trajectories)
are read whole, answers included (each source read as native), and tokenized by the tokenize step
once without a limit (the lengths), then at each ``--max-length`` (what each keeps: the manifest's
count of the assistant tokens truncation drops).

The tokenizer is ``--target``'s (the real job's, e.g. Kimi-K2.5's folder, where it is at hand),
or else the embedded tiny one, which is trained on these samples. ``--conversations FILE`` measures
a conversations file instead (the real job's ``native.jsonl`` or generate's output).

    .venv/bin/python -m benchmarks.row_lengths [--target DIR] [--chat-template NAME] [--conversations FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from pipeline.steps.prep.catalog import load_catalog
from pipeline.steps.prep.sources import part_records, prepare_source
from pipeline.steps.tokenize.chat_template import OWN_TEMPLATE
from pipeline.steps.tokenize.run import run_tokenize

AGENTIC = ("hermes_agent_kimi", "swe_smith_trajectories")
LIMITS = (2048, 4096, 32768)
NO_LIMIT = sys.maxsize


def agentic_conversations(out: Path) -> Path:
    """The agentic samples as a conversations file, each row whole (every turn, every answer)."""
    catalog = load_catalog()
    with open(out, "w", encoding="utf-8") as dest:
        for source in (s for s in catalog.sources if s.name in AGENTIC):
            native = source.model_copy(update={"native": True, "quota": None})
            part = out.parent / f"{source.name}.part"
            result = prepare_source(native, native.location(catalog.base, True), part, 100)
            if result.error:
                raise SystemExit(result.error)
            dest.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part_records(part))
    return out


def tokenized(target: str, template: str, conversations: Path, out: Path, max_length: int) -> dict:
    """The tokenize step's manifest stats at ``max_length`` (its console output kept back)."""
    from pipeline.contract.step import read_manifest

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = run_tokenize(target, [conversations], [], out, chat_template=template, max_length=max_length)
    if code:
        raise SystemExit(said.getvalue())
    return read_manifest(out).stats


def percentile(ordered: list[int], share: float) -> int:
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def lengths_table(shards: Path) -> list[str]:
    """Per source: rows, and their tokens and assistant tokens (min, median, p90, max)."""
    import pyarrow.parquet as pq

    table = pq.read_table(shards).to_pylist()
    lines = ["| source | rows | tokens: min / median / p90 / max | assistant tokens: median / max |"]
    lines.append("|---|---:|---|---|")
    for source in sorted({row["source"] for row in table}):
        rows = [row for row in table if row["source"] == source]
        tokens = sorted(len(row["input_ids"]) for row in rows)
        assistant = sorted(sum(row["loss_mask"]) for row in rows)
        spread = " / ".join(f"{percentile(tokens, q):,}" for q in (0, 0.5, 0.9, 1))
        lines.append(
            f"| {source} | {len(rows)} | {spread} | {percentile(assistant, 0.5):,} / {assistant[-1]:,} |"
        )
    return lines


def kept_table(whole: dict, limited: dict[int, dict]) -> list[str]:
    """Per limit: rows truncated, and the share of the assistant tokens kept."""
    total = whole["totals"]["assistant_tokens"]
    lines = ["| --max-length | rows truncated | assistant tokens dropped | assistant tokens kept |"]
    lines.append("|---:|---:|---:|---:|")
    for limit, stats in limited.items():
        totals = stats["totals"]
        dropped, kept = totals["assistant_tokens_truncated"], totals["assistant_tokens"]
        lines.append(
            f"| {limit:,} | {totals['truncated']} of {whole['totals']['conversations']} | "
            f"{dropped:,} | {kept:,} of {total:,} ({kept / total:.1%}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a tokenizer or model folder (default: the embedded tiny tokenizer)")
    parser.add_argument("--chat-template", default=OWN_TEMPLATE)
    parser.add_argument(
        "--conversations", type=Path, help="a conversations file (default: the agentic samples)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        if args.target is None:
            from pipeline.embedded.tiny import build_tokenizer

            target, named = str(build_tokenizer(work_dir / "tiny")), "the embedded tiny tokenizer"
        else:
            target, named = args.target, args.target
        conversations = args.conversations or agentic_conversations(work_dir / "conversations.jsonl")
        whole = tokenized(target, args.chat_template, conversations, work_dir / "whole", NO_LIMIT)
        limited = {
            limit: tokenized(target, args.chat_template, conversations, work_dir / str(limit), limit)
            for limit in LIMITS
        }
        rows = args.conversations or f"the samples of {', '.join(AGENTIC)}"
        print(f"tokenizer: {named}, chat template {args.chat_template!r}; rows: {rows}\n")
        print("\n".join(lengths_table(work_dir / "whole" / "shards")) + "\n")
        print("\n".join(kept_table(whole, limited)))


if __name__ == "__main__":
    main()
