"""Fixtures of the prep and tokenize tests: the embedded tokenizer, a Kimi-K2 variant, prepped samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.steps.prep.catalog import load_catalog
from pipeline.steps.prep.run import run_prep
from pipeline.steps.prep.sources import part_records, prepare_source
from pipeline.steps.tokenize.chat_template import KIMI_K2_SPECIAL_TOKENS


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    from pipeline.embedded.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tiny") / "tokenizer")


@pytest.fixture(scope="session")
def kimi_tokenizer(tiny_tokenizer, tmp_path_factory) -> Path:
    """The embedded tokenizer plus the Kimi-K2 markup tokens, as a Kimi target's tokenizer has them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_K2_SPECIAL_TOKENS})
    out = tmp_path_factory.mktemp("kimi") / "tokenizer"
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def unmarked_template(tmp_path_factory) -> Path:
    """The embedded ChatML template without its {% generation %} markers: spans from rendered prefixes."""
    import re

    from pipeline.embedded.tiny import CHAT_TEMPLATE

    path = tmp_path_factory.mktemp("unmarked") / "chatml.jinja"
    path.write_text(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHAT_TEMPLATE))
    return path


@pytest.fixture(scope="session")
def prepped(tmp_path_factory) -> Path:
    """``eyrie prep --offline`` on the default catalog, once per session."""
    out = tmp_path_factory.mktemp("prep")
    assert run_prep(None, out, offline=True) == 0
    return out


@pytest.fixture(scope="session")
def sample_conversations(tmp_path_factory) -> list[tuple[str, dict]]:
    """Every sample conversation of the default catalog, answers included (each source read as native)."""
    catalog = load_catalog()
    parts = tmp_path_factory.mktemp("conversations")
    out = []
    for source in catalog.sources:
        if source.format == "tokenized":
            continue
        native = source.model_copy(update={"native": True, "quota": None})
        result = prepare_source(native, native.location(catalog.base, True), parts / source.name, 100)
        assert result.error is None, result.error
        out += [(source.name, record) for record in part_records(result.parts[0])]
    return out
