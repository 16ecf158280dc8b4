"""Pieces are cut only where the tokenizer itself splits: what makes them tokenize as the whole.

The mask reference test checks the shipped templates token for token; these check the
gates: edges that touch no added token, added tokens that strip whitespace or can
overlap another, and pre-tokenizers that treat the text's first split specially.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pipeline.steps.tokenize.pieces import Pieces


def test_edges_touching_added_tokens_cut_into_pieces_of_one_mask_value(kimi_tokenizer):
    hf = AutoTokenizer.from_pretrained(str(kimi_tokenizer))
    pieces = Pieces.for_tokenizer(hf)
    assert pieces is not None
    text = "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>hello<|im_end|>"
    start = text.rindex("<|im_middle|>") + len("<|im_middle|>")
    cut = pieces.cut(text, [(start, len(text))])
    assert cut == [(0, start, 0), (start, len(text), 1)]
    whole = hf.backend_tokenizer.encode(text, add_special_tokens=False).ids
    parts = [hf.backend_tokenizer.encode(text[a:b], add_special_tokens=False).ids for a, b, _ in cut]
    assert parts[0] + parts[1] == whole
    # an edge inside plain text ("hel|lo") touches no added token: no pieces, the whole path with offsets
    assert pieces.cut(text, [(start + 3, len(text))]) is None


def test_added_tokens_that_strip_or_overlap_do_not_cut(tiny_tokenizer):
    hf = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    hf.add_tokens(
        [
            AddedToken("<sep>", lstrip=True, normalized=False),
            AddedToken("<a|b>", normalized=False),
            AddedToken("x<a", normalized=False),
            AddedToken("<c|d>", normalized=False),
            AddedToken("<e|<e|", normalized=False),
        ]
    )
    pieces = Pieces.for_tokenizer(hf)
    assert pieces is not None
    # "<sep>" takes the spaces before it into itself: a piece ending before them would keep them
    text = "user text  <sep>answer"
    assert pieces.cut(text, [(text.index("<sep>"), len(text))]) is None
    # "x<a" can run into "<a|b>": the tokenizer matches the leftmost, and "<a|b>" is then not a token
    text = "questionx<a|b>answer"
    tokens = hf.convert_ids_to_tokens(hf.backend_tokenizer.encode(text, add_special_tokens=False).ids)
    assert "x<a" in tokens and "<a|b>" not in tokens
    assert pieces.cut(text, [(text.index("answer"), len(text))]) is None
    # "<e|<e|" can overlap itself: in "<e|<e|<e|" only the first is a token, not the one ending last
    text = "question<e|<e|<e|answer"
    assert pieces.cut(text, [(text.index("answer"), len(text))]) is None
    # "<c|d>" can overlap nothing: an edge after it cuts
    text = "question<c|d>answer"
    assert pieces.cut(text, [(text.index("answer"), len(text))]) == [(0, 13, 0), (13, 19, 1)]


def test_a_pre_tokenizer_that_prepends_to_the_first_split_only_never_takes_pieces():
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.train_from_iterator(
        ["hello world", "answer me", "<end>"] * 20,
        trainers.BpeTrainer(vocab_size=64, special_tokens=["<unk>", "<end>"]),
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    text = "hello<end>answer"
    whole = backend.encode(text, add_special_tokens=False).ids
    right = backend.encode("answer", add_special_tokens=False).ids
    # a piece starts a text of its own, so it would get the prefix the whole text gives only its start
    assert whole[-len(right) :] != right
    assert Pieces.for_tokenizer(hf) is None
