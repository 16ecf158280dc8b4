"""A tiktoken-based slow tokenizer (Kimi-K2.5's ``tokenization_kimi.py`` over ``tiktoken.model``)
as a fast one: converted once, by transformers' own ``TikTokenConverter``, and cached.

The loss mask needs each token's character offsets, which only a fast tokenizer gives. The
conversion takes what the slow tokenizer itself runs on, its ``tiktoken.Encoding``: the BPE
file, the split pattern (``_pat_str``, the tokenizer's own, not the converter's generic
default) and the special tokens with their ids. The result, a ``tokenizer.json``, is kept
under ``$EYRIE_CACHE_DIR/tokenizers/<key>/`` where the key hashes the BPE file's content,
the pattern, the special tokens and the converter's transformers release, so a second run
loads it in milliseconds. Whether it splits text as the slow one does is checked by the
step on its own rows before any is written (``Tokenizer.check_against_own``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.contract.atomic import atomic_path
from pipeline.contract.step import cache_root
from pipeline.steps.target import TargetError

CACHE_FOLDER = "tokenizers"
TOKENIZER_FILE = "tokenizer.json"
# The special tokens a tokenizer names by role; each keeps its role in the fast tokenizer.
_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tiktoken_encoding(slow: Any) -> Any | None:
    """The ``tiktoken.Encoding`` a slow tokenizer runs on (one of its attributes), or None."""
    try:
        import tiktoken
    except ImportError:
        return None
    return next((v for v in vars(slow).values() if isinstance(v, tiktoken.Encoding)), None)


def _bpe_file(slow: Any, target: str | Path) -> Path:
    vocab_file = getattr(slow, "vocab_file", None) or slow.init_kwargs.get("vocab_file")
    if not vocab_file or not Path(vocab_file).is_file():
        raise TargetError(
            f"--tokenizer {target}: its tiktoken tokenizer names no BPE file (vocab_file) that exists; "
            "pass a folder holding its tiktoken.model"
        )
    return Path(vocab_file)


def _special_tokens(encoding: Any) -> list[str]:
    """The encoding's special tokens in id order, from the first id after the BPE ranks, a gap
    filled with a reserved name (as transformers fills one), so that each keeps its id."""
    by_id = {index: token for token, index in encoding._special_tokens.items()}
    ids = range(len(encoding._mergeable_ranks), max(by_id, default=-1) + 1)
    return [by_id.get(index, f"<|reserved_token_{index}|>") for index in ids]


def cache_key(bpe_file: Path, encoding: Any) -> str:
    import transformers

    digest = hashlib.sha256(bpe_file.read_bytes())
    described = [encoding._pat_str, sorted(encoding._special_tokens.items()), transformers.__version__]
    digest.update(json.dumps(described).encode())
    return digest.hexdigest()[:16]


def convert(bpe_file: Path, encoding: Any) -> Any:
    """The ``tokenizers.Tokenizer`` of a tiktoken encoding, by transformers' converter."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(
        vocab_file=str(bpe_file), pattern=encoding._pat_str, extra_special_tokens=_special_tokens(encoding)
    )
    return converter.converted()


def fast_from_tiktoken(slow: Any, target: str | Path) -> tuple[Any, Path] | None:
    """``(fast tokenizer, its cached tokenizer.json)`` for a tiktoken-based slow tokenizer, converted
    on the first call and read from the cache after; None for a slow tokenizer of another kind."""
    from transformers import PreTrainedTokenizerFast

    encoding = tiktoken_encoding(slow)
    if encoding is None:
        return None
    bpe_file = _bpe_file(slow, target)
    cached = cache_root() / CACHE_FOLDER / cache_key(bpe_file, encoding) / TOKENIZER_FILE
    if not cached.is_file():
        backend = convert(bpe_file, encoding)
        wrong = [t for t, i in encoding._special_tokens.items() if backend.token_to_id(t) != i]
        if len(backend.get_vocab()) != encoding.n_vocab or wrong:
            raise TargetError(
                f"--tokenizer {target}: its BPE file {bpe_file.name} does not hold the ranks its tokenizer "
                f"runs on{' (special tokens ' + ', '.join(wrong) + ' move)' if wrong else ''}; "
                "pass the target's own tokenizer folder"
            )
        with atomic_path(cached) as tmp:  # swapped in whole: a concurrent run reads the old or the new
            backend.save(str(tmp))
    roles = {role: getattr(slow, role) for role in _ROLES if getattr(slow, role, None) is not None}
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(cached),
        chat_template=slow.chat_template,
        model_max_length=slow.model_max_length,
        clean_up_tokenization_spaces=False,
        **roles,
    )
    return fast, cached
