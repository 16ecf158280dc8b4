"""Kimi-K2.5's tokenizer as it ships: a tiktoken slow tokenizer of its own (remote code) and a chat
template without generation markers.

The fast tokenizer is converted from the slow one once, cached, and checked token for
token against it on the step's rows; the generic fast tokenizer transformers builds from
``tiktoken.model`` by itself splits contractions differently and is never used. Spans come
from per-message probes, in linear time, equal to the rendered-prefix method's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eyrie_testing import eyrie
from pipeline.contract.step import read_manifest
from pipeline.steps.chat_format import kimi_tool_call_ids
from pipeline.steps.tokenize import fast
from pipeline.steps.tokenize.chat_template import ChatTemplate, TokenizeError, render
from pipeline.steps.tokenize.loss_mask import assistant_spans, mask_from_offsets, prefix_spans, probe_spans
from pipeline.steps.tokenize.run import run_tokenize
from pipeline.steps.tokenize.tokenizer import Tokenizer
from tests.fixtures.kimi_k25.tokenizer import write_kimi_tokenizer

CONTRACTIONS = [" that's", "I'll"]


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi_k25") / "tokenizer"
    write_kimi_tokenizer(folder)
    return folder


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: each test starts with no converted tokenizer."""
    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def own(kimi_k25):
    """The target's own tokenizer: the slow, remote-code class."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(kimi_k25), trust_remote_code=True)


@pytest.fixture(scope="module")
def conversations_file(sample_conversations, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kimi_conversations") / "conversations.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for source, record in sample_conversations:
            row = {"id": record["id"], "source": source, "conversations": record["conversations"]}
            out.write(json.dumps({**row, "tools": record.get("tools")}, ensure_ascii=False) + "\n")
    return path


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_the_conversion_is_made_once_and_cached(kimi_k25, cache, monkeypatch):
    conversions = []
    convert = fast.convert
    monkeypatch.setattr(fast, "convert", lambda *a: conversions.append(a) or convert(*a))
    first = Tokenizer(str(kimi_k25), "tokenizer", trust_remote_code=True)
    assert first.own is not None and not first.own.is_fast and first.hf.is_fast
    assert first.converted.is_file() and first.converted.is_relative_to(cache / "tokenizers")
    written = first.converted.stat().st_mtime_ns
    second = Tokenizer(str(kimi_k25), "tokenizer", trust_remote_code=True)
    assert len(conversions) == 1
    assert second.converted == first.converted and second.converted.stat().st_mtime_ns == written
    # the cached file is transformers' converter run on the slow tokenizer's own split pattern
    assert json.loads(first.converted.read_text())["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {
        "Regex": first.own.model._pat_str
    }


def test_converted_tokenizer_matches_its_own_on_every_sample(kimi_k25, own, sample_conversations):
    tokenizer = Tokenizer(str(kimi_k25), "tokenizer", trust_remote_code=True)
    assert tokenizer.vocab_size == len(own) and tokenizer.hf.get_vocab() == own.get_vocab()
    for source, record in sample_conversations:
        text, _, _ = tokenizer.render(record["conversations"], record.get("tools"))
        ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
        assert ids == own.encode(text, add_special_tokens=False), (source, record["id"])
    for text in CONTRACTIONS:
        assert tokenizer.backend.encode(text, add_special_tokens=False).ids == own.encode(text)


def test_the_generic_fast_tokenizer_splits_contractions_unlike_the_targets_own(kimi_k25, own):
    """What transformers builds from tiktoken.model without the target's class: another split."""
    from transformers import PreTrainedTokenizerFast

    generic = PreTrainedTokenizerFast.from_pretrained(str(kimi_k25))
    for text in CONTRACTIONS:
        assert len(own.encode(text)) == 1  # " that's" and "I'll" are one token of the target's
        assert generic.encode(text, add_special_tokens=False) != own.encode(text), text


def test_a_fast_tokenizer_that_disagrees_is_refused_and_nothing_written(
    kimi_k25, conversations_file, tmp_path, capsys
):
    """The generic fast tokenizer in the converted one's place: the check on the rows refuses it."""
    from transformers import PreTrainedTokenizerFast

    converted = Tokenizer(str(kimi_k25), "tokenizer", trust_remote_code=True).converted
    PreTrainedTokenizerFast.from_pretrained(str(kimi_k25)).backend_tokenizer.save(str(converted))
    out = tmp_path / "tok"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # an earlier attempt's: left as it was
    assert run_tokenize(str(kimi_k25), [conversations_file], [], out, trust_remote_code=True) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{conversations_file}:" in line and "differs from it at token" in line and str(converted) in line
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_without_trust_remote_code_the_tokenizer_is_refused(kimi_k25, conversations_file, tmp_path, capsys):
    out = tmp_path / "tok"
    assert run_tokenize(str(kimi_k25), [conversations_file], [], out) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "ships its own code" in line and "--trust-remote-code" in line
    assert not out.exists()


def test_spans_from_message_probes_equal_the_prefix_method_on_every_sample(
    kimi_k25, tiny_tokenizer, unmarked_template, sample_conversations
):
    """Kimi-K2.5's own template (through its own tokenizer) and ChatML without its markers."""
    for folder, template in ((kimi_k25, "tokenizer"), (tiny_tokenizer, str(unmarked_template))):
        tokenizer = Tokenizer(str(folder), template, trust_remote_code=True)
        assert not tokenizer.template.markers and tokenizer.template.method == "message_probes"
        batch = [(record["conversations"], record.get("tools")) for _, record in sample_conversations]
        encoded = tokenizer.encode_batch(batch)
        records = [record for _, record in sample_conversations]
        for record, (messages, tools), result in zip(records, batch, encoded, strict=True):
            if tokenizer.template.names_calls_by_id:
                messages = kimi_tool_call_ids(messages)
            text, _ = render(tokenizer.template, messages, tools, special=tokenizer.special)
            expected = prefix_spans(tokenizer.template, messages, tools, tokenizer.special, text)
            assert assistant_spans(tokenizer.template, messages, tools, tokenizer.special) == (
                text,
                expected,
                False,
            )
            if folder == kimi_k25:  # Kimi's template renders each message by itself: one render per message
                assert (
                    probe_spans(tokenizer.template, messages, tools, tokenizer.special, text, 0) == expected
                )
            encoding = tokenizer.backend.encode(text, add_special_tokens=False)
            ids, mask, _ = result
            assert (ids, mask) == (encoding.ids, mask_from_offsets(encoding.offsets, expected)), record["id"]


def template(source: str) -> ChatTemplate:
    return ChatTemplate("probe", source, markers=False)


MESSAGES = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b", "reasoning_content": "r"},
    {"role": "user", "content": "c"},
    {"role": "assistant", "content": "d", "reasoning_content": "s"},
]


def test_a_template_that_numbers_turns_falls_back_to_rendered_prefixes():
    """Probes render each message out of place (turn 1 of 2): the whole disagrees, prefixes do not."""
    numbered = template(
        "{% for m in messages %}{{ loop.index }}{{ m.role }}:{{ m.content }}|{% endfor %}"
        "{% if add_generation_prompt %}{{ messages | length + 1 }}assistant:{% endif %}"
    )
    text, _ = render(numbered, MESSAGES, None)
    assert probe_spans(numbered, MESSAGES, None, {}, text) is None
    rendered, spans, by_prefix = assistant_spans(numbered, MESSAGES, None, {})
    assert by_prefix and [rendered[a:b] for a, b in spans] == ["b|", "d|"]


def test_a_template_whose_prefixes_differ_from_the_whole_is_still_refused():
    """Reasoning kept only on the last message: a prefix through an earlier one renders it, the whole not."""
    last_only = template(
        "{% for m in messages %}{{ m.role }}:{% if loop.last %}{{ m.reasoning_content }}{% endif %}"
        "{{ m.content }}|{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(TokenizeError, match="renders a conversation's prefixes differently from the whole"):
        assistant_spans(last_only, MESSAGES, None, {})


def test_eyrie_tokenize_with_the_targets_own_tokenizer_and_template(
    kimi_k25, own, conversations_file, tmp_path
):
    out = tmp_path / "tok"
    eyrie(
        "tokenize",
        "--tokenizer",
        str(kimi_k25),
        "--trust-remote-code",
        "--conversations",
        str(conversations_file),
        "--out-dir",
        str(out),
        "--workers",
        "2",
        check=True,
    )
    stats = read_manifest(out).stats
    assert stats["mask_method"] == "message_probes" and stats["totals"]["spans_from_prefixes"] == 0
    lines = conversations_file.read_text(encoding="utf-8").splitlines()
    assert stats["tokenizer"]["checked_conversations"] == min(256, len(lines))
    table = pq.read_table(sorted((out / "shards").glob("shard-*.parquet"))[0])
    assert stats["totals"]["rows"] == len(lines) and table.num_rows > 0
    # a row is the target's own tokens of the conversation its own template renders
    row = table.slice(0, 1).to_pylist()[0]
    record = next(json.loads(line) for line in lines if json.loads(line)["id"] == row["id"])
    own_template = Tokenizer(str(kimi_k25), "tokenizer", trust_remote_code=True).template
    messages = kimi_tool_call_ids(record["conversations"])
    text, _ = render(own_template, messages, record.get("tools"), special=dict(own.special_tokens_map))
    assert row["input_ids"] == own.encode(text, add_special_tokens=False)[: len(row["input_ids"])]
    assert own.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]).endswith(
        "<|im_end|>"
    )
