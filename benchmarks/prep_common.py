"""What the prep benchmarks share: the embedded tokenizers and conversations built from the samples."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from pipeline.steps.prep.catalog import load_catalog
from pipeline.steps.prep.sources import part_records, prepare_source
from pipeline.steps.tokenize.chat_template import KIMI_K2_SPECIAL_TOKENS

TEMPLATES = ("kimi-k2", "tokenizer", "unmarked")


def tokenizers(work: Path) -> dict[str, tuple[Path, str]]:
    """Template name -> (tokenizer folder, --chat-template): the embedded tokenizer with its own
    ChatML template (generation markers), the same template without its markers (spans from
    message probes), and the tokenizer with the Kimi-K2 markup tokens for the shipped Kimi template."""
    from transformers import AutoTokenizer

    from pipeline.embedded.tiny import CHAT_TEMPLATE, build_tokenizer

    tiny = build_tokenizer(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_K2_SPECIAL_TOKENS})
    tokenizer.save_pretrained(str(work / "kimi"))
    unmarked = work / "unmarked.jinja"
    unmarked.write_text(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHAT_TEMPLATE))
    return {
        "tokenizer": (tiny, "tokenizer"),
        "kimi-k2": (work / "kimi", "kimi-k2"),
        "unmarked": (tiny, str(unmarked)),
    }


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
            out += part_records(result.parts[0])
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
