"""Tokenize cost per token at 1, 8 and 64 turns per conversation (goal: <= 1.2x from 1 to 64 turns).

Templates: the embedded ones (``prep_common.TEMPLATES``) and ``kimi-k2.5``, the Kimi-K2.5-style
fixture (tests/fixtures/kimi_k25): its own tiktoken tokenizer, converted to a fast one, and its
own template, which has no generation markers (spans from per-message probes).

Each conversation is k user/assistant pairs cut from the sample conversations; the
number of conversations shrinks as k grows so every size tokenizes about the same
number of tokens. Timed: ``Tokenizer.encode_batch`` (render, one tokenization, mask)
in batches, median over repeats. For contrast, the per-turn prefix tokenization
the loss-mask test uses as its reference (O(n^2) in turns) is timed on a few conversations.

    .venv/bin/python -m benchmarks.prep_turns --tokens 400000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.prep_common import TEMPLATES, median, sample_conversations, tokenizers
from pipeline.contract.step import CACHE_DIR_ENV

TURNS = (1, 8, 64)
KIMI_K25 = "kimi-k2.5"


def pairs() -> list[tuple[dict, dict]]:
    """(user, assistant) pairs from the samples, answers with reasoning and tool calls included."""
    out = []
    for record in sample_conversations():
        messages = record["conversations"]
        for user, answer in zip(messages, messages[1:], strict=False):
            if user["role"] == "user" and answer["role"] == "assistant":
                out.append((user, answer))
    return out


def conversations(turns: int, count: int, source: list[tuple[dict, dict]]) -> list[tuple[list[dict], None]]:
    out, cursor = [], 0
    for _ in range(count):
        messages = []
        for _ in range(turns):
            user, answer = source[cursor % len(source)]
            messages += [user, answer]
            cursor += 1
        out.append((messages, None))
    return out


def time_encode(encoder, batch: list, repeats: int) -> tuple[float, int]:
    from pipeline.steps.tokenize.run import BATCH

    times, tokens = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = 0
        for i in range(0, len(batch), BATCH):
            for ids, _, _ in encoder.encode_batch(batch[i : i + BATCH]):
                tokens += len(ids)
        times.append(time.perf_counter() - started)
    return median(times), tokens


def time_reference(encoder, batch: list) -> tuple[float, int]:
    """Per-turn prefix tokenization: the quadratic method the incident's prep used."""
    from pipeline.steps.tokenize.chat_template import render

    started, tokens = time.perf_counter(), 0
    for messages, tools in batch:
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                for prefix, prompt in ((messages[:i], True), (messages[: i + 1], False)):
                    text = render(encoder.template, prefix, tools, prompt, encoder.special)[0]
                    encoder.backend.encode(text, add_special_tokens=False)
        full = render(encoder.template, messages, tools, special=encoder.special)[0]
        tokens += len(encoder.backend.encode(full, add_special_tokens=False).ids)
    return time.perf_counter() - started, tokens


def main() -> None:
    from pipeline.steps.tokenize.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400_000, help="about this many tokens per size")
    parser.add_argument("--repeats", type=int, default=3)
    choices = [*TEMPLATES, KIMI_K25]
    parser.add_argument("--templates", nargs="+", default=choices, choices=choices)
    args = parser.parse_args()
    source = pairs()
    with tempfile.TemporaryDirectory() as tmp:
        folders = tokenizers(Path(tmp))
        if KIMI_K25 in args.templates:
            from tests.fixtures.kimi_k25.tokenizer import write_kimi_tokenizer

            write_kimi_tokenizer(Path(tmp) / "kimi_k25")
            os.environ[CACHE_DIR_ENV] = str(Path(tmp) / "cache")  # converted here, not in the user's cache
        header = ["template (mask method)", "turns", "conversations", "tokens", "us/token", "vs 1 turn"]
        print("| " + " | ".join([*header, "reference us/token"]) + " |")
        print("|---|---|---|---|---|---|---|")
        for template in args.templates:
            if template == KIMI_K25:
                encoder = Tokenizer(str(Path(tmp) / "kimi_k25"), "tokenizer", trust_remote_code=True)
            else:
                encoder = Tokenizer(*folders[template])
            per_pair = max(1, time_encode(encoder, conversations(1, 64, source), 1)[1] // 64)
            base = None
            for turns in TURNS:
                count = max(4, args.tokens // (per_pair * turns))
                batch = conversations(turns, count, source)
                seconds, tokens = time_encode(encoder, batch, args.repeats)
                cost = seconds / tokens * 1e6
                base = base or cost
                ref_seconds, ref_tokens = time_reference(encoder, batch[: max(2, 64 // turns)])
                method = "generation markers" if encoder.template.markers else "message probes"
                reference = ref_seconds / ref_tokens * 1e6
                print(
                    f"| {template} ({method}) | {turns} | {count} | {tokens} | {cost:.3f} "
                    f"| {cost / base:.2f}x | {reference:.3f} |"
                )


if __name__ == "__main__":
    main()
