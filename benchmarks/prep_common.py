"""What the prep benchmarks share: the embedded tokenizers and conversations built from the samples."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pipeline.steps.prep.catalog import load_catalog
from pipeline.steps.prep.sources import prepare_source
from pipeline.steps.prep.tokenize import KIMI_K2_SPECIAL_TOKENS

TEMPLATES = ("kimi-k2", "tokenizer")


def tokenizers(work: Path) -> dict[str, Path]:
    """Template name -> tokenizer folder: the embedded tokenizer (its ChatML template, no generation
    markers) and the same tokenizer with the Kimi-K2 markup tokens for the shipped Kimi template."""
    from transformers import AutoTokenizer

    from pipeline.embedded.tiny import build_tokenizer

    tiny = build_tokenizer(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_K2_SPECIAL_TOKENS})
    tokenizer.save_pretrained(str(work / "kimi"))
    return {"tokenizer": tiny, "kimi-k2": work / "kimi"}


def sample_conversations() -> list[dict]:
    """Every sample conversation of the default catalog with its answers (each source read as native)."""
    catalog = load_catalog()
    out = []
    with tempfile.TemporaryDirectory() as parts:
        for source in catalog.sources:
            if source.format == "tokenized":
                continue
            native = source.model_copy(update={"native": True, "quota": None})
            result = prepare_source(
                native, native.location(catalog.base, True), Path(parts) / source.name, 100
            )
            with open(result.part, encoding="utf-8") as fh:
                out += [json.loads(line.split("\t", 1)[1]) for line in fh]
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
