"""The embedded tiny target: a BPE tokenizer and a small Llama, both made from the bundled samples.

One place makes it, for every user (the generation step serves it, the training
step distils it, the tests use it):

- the tokenizer is a byte-level BPE trained with HF ``tokenizers`` on every string
  found in ``samples/*.jsonl`` / ``samples/*.json``, with a ChatML chat template that
  renders system/user/assistant/tool turns, ``tool_calls`` and ``reasoning_content``;
- the model is a random-init ``LlamaForCausalLM`` (a few layers, hidden 128), then
  trained briefly on the samples rendered through that template, so its greedy
  answers are text-like and end with ``<|im_end|>`` instead of repeating one token.

Everything is deterministic from ``SEED`` and the sample files. The result is kept in a
cache keyed by a fingerprint of both (``$EYRIE_CACHE_DIR``, default ``~/.cache/eyrie``),
so a second call copies a folder instead of training again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.contract.atomic import atomic_path
from pipeline.contract.step import cache_root, step_dir_from_env, write_manifest

SAMPLES_DIR = Path(__file__).parent / "samples"
SEED = 1234
# Bump when the recipe below changes: it is part of the cache fingerprint.
RECIPE_VERSION = 2

VOCAB_SIZE = 4096
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
TRAIN_STEPS = 320
TRAIN_BATCH = 8
TRAIN_WINDOW = 128
TRAIN_LR = 3e-3
_DONE_MARKER = ".eyrie-tiny"

# ChatML, as Qwen-style targets render it. Content may be a string or a list of
# OpenAI content parts; tool-call arguments may be a JSON string or an object.
# {% generation %} marks what the assistant produces (through <|im_end|> and the newline
# after it, as a rendered prefix would), so the loss mask takes one rendering.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ render(messages[0].content) + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{%- if not (tools and loop.first) -%}"
    "{{ '<|im_start|>system\\n' + render(message.content) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- elif message.role == 'user' -%}"
    "{{ '<|im_start|>user\\n' + render(message.content) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}"
    "{%- if message.reasoning_content -%}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n' }}"
    "{%- endif -%}"
    "{{ render(message.content) }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if fn.arguments is string -%}{%- set args = fn.arguments -%}"
    "{%- else -%}{%- set args = fn.arguments | tojson -%}{%- endif -%}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + (fn.name | tojson) }}"
    "{{ ', \"arguments\": ' + args + '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endgeneration -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + render(message.content) }}"
    "{{ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)

_ROLE_MAP = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}


# ---------------------------------------------------------------- sample text


def _sample_files(samples_dir: Path) -> list[Path]:
    files = sorted(p for p in samples_dir.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json"))
    if not files:
        raise FileNotFoundError(
            f"no .jsonl/.json sample files under {samples_dir}: the tiny target is trained on them"
        )
    return files


def _sample_rows(samples_dir: Path) -> Iterator[Any]:
    for path in _sample_files(samples_dir):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            for line in text.splitlines():
                if line.strip():
                    yield json.loads(line)
        else:
            data = json.loads(text)
            yield from data if isinstance(data, list) else [data]


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value; a string that is itself JSON is walked too."""
    if isinstance(value, str):
        if value.strip():
            yield value
        if value[:1] in "[{":
            try:
                inner = json.loads(value)
            except ValueError:
                return
            yield from _strings(inner)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def sample_texts(samples_dir: Path = SAMPLES_DIR) -> list[str]:
    """Every string of every bundled sample row, in file order."""
    return [s for row in _sample_rows(samples_dir) for s in _strings(row)]


def _as_turns(value: Any) -> list[dict[str, Any]] | None:
    """A list of role/content (or from/value) dicts as chat messages, else None."""
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        return None
    turns = []
    for m in value:
        role = _ROLE_MAP.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, (str, type(None))):
            return None
        turn: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant" and m.get("reasoning_content"):
            turn["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            turn["tool_calls"] = m["tool_calls"]
        turns.append(turn)
    return turns


def sample_conversations(samples_dir: Path = SAMPLES_DIR) -> list[list[dict[str, Any]]]:
    """The bundled rows as chat conversations, whatever their schema.

    A row holding a list of role/content or from/value turns gives that conversation;
    any other row becomes one exchange: its longest string answers the others.
    """
    conversations = []
    for row in _sample_rows(samples_dir):
        if not isinstance(row, dict):
            continue
        found = [t for v in row.values() if (t := _as_turns(v))]
        if found:
            conversations.extend(found)
            continue
        texts = [v for v in row.values() if isinstance(v, str) and len(v.strip()) >= 8]
        if len(texts) >= 2:
            answer = max(texts, key=len)
            question = "\n".join(t for t in texts if t is not answer)
            conversations.append(
                [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            )
    return conversations


def _fingerprint(samples_dir: Path, kind: str) -> str:
    digest = hashlib.sha256(f"{kind}:{RECIPE_VERSION}:{SEED}:{VOCAB_SIZE}".encode())
    digest.update(CHAT_TEMPLATE.encode())
    if kind in ("target", "distill"):
        digest.update(json.dumps(MODEL_CONFIG, sort_keys=True).encode())
        digest.update(f"{TRAIN_STEPS}:{TRAIN_BATCH}:{TRAIN_WINDOW}:{TRAIN_LR}".encode())
    if kind == "distill":
        digest.update(f"{DISTILL_PROMPT_TOKENS}:{DISTILL_NEW_TOKENS}".encode())
    for path in _sample_files(samples_dir):
        digest.update(str(path.relative_to(samples_dir)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- caching


def _is_built(folder: Path, fingerprint: str) -> bool:
    marker = folder / _DONE_MARKER
    return marker.is_file() and marker.read_text().strip() == fingerprint


def _cached(kind: str, samples_dir: Path, build) -> Path:
    """Build once into the cache (under a lock, so parallel callers wait instead of racing)."""
    fingerprint = _fingerprint(samples_dir, kind)
    folder = cache_root() / f"tiny-{kind}-{fingerprint}"
    if _is_built(folder, fingerprint):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".tiny-{kind}-{fingerprint}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_built(folder, fingerprint):
            with atomic_path(folder) as tmp:
                tmp.mkdir()
                build(tmp, samples_dir)
                (tmp / _DONE_MARKER).write_text(fingerprint + "\n")
    return folder


def _place(source: Path, out_dir: str | os.PathLike[str] | None) -> Path:
    """Copy a cached folder to ``out_dir`` (atomically) unless it already holds the same build."""
    if out_dir is None:
        return source
    out = Path(out_dir)
    fingerprint = (source / _DONE_MARKER).read_text().strip()
    if out.resolve() == source.resolve() or _is_built(out, fingerprint):
        return out
    with atomic_path(out) as tmp:
        shutil.copytree(source, tmp)
    return out


# ---------------------------------------------------------------- tokenizer


def _train_tokenizer(out: Path, samples_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = sample_texts(samples_dir)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)


def build_tokenizer(
    out_dir: str | os.PathLike[str] | None = None, *, samples_dir: Path = SAMPLES_DIR
) -> Path:
    """The tiny target's tokenizer folder (``AutoTokenizer.from_pretrained`` loads it). Fast."""
    return _place(_cached("tokenizer", samples_dir, _train_tokenizer), out_dir)


# ---------------------------------------------------------------- model


def _training_stream(tokenizer, samples_dir: Path) -> list[int]:
    """The samples rendered through the chat template, as one token stream."""
    ids: list[int] = []
    for conversation in sample_conversations(samples_dir):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
        except Exception:  # a row the template cannot render is skipped, not fatal
            continue
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return ids


def _train_target(out: Path, samples_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(samples_dir=samples_dir))
    stream = torch.tensor(_training_stream(tokenizer, samples_dir), dtype=torch.long)
    if len(stream) <= TRAIN_WINDOW + 1:
        raise ValueError(f"the samples under {samples_dir} give only {len(stream)} tokens")

    # One thread: the result does not depend on the core count, and a shared machine's
    # other processes do not stall OpenMP barriers.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fit(out, tokenizer, stream)
    finally:
        torch.set_num_threads(threads)


def _fit(out: Path, tokenizer, stream) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )
    model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=TRAIN_LR, total_steps=TRAIN_STEPS, pct_start=0.05
    )
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(TRAIN_WINDOW + 1)
    # Half the windows begin where a row does: a prompt meets the model at position 0, and
    # windows drawn anywhere alone leave it unsure what follows a generation prompt.
    last_start = len(stream) - TRAIN_WINDOW - 1
    row_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    row_starts = torch.cat([torch.zeros(1, dtype=torch.long), (stream == row_end).nonzero()[:, 0] + 1])
    row_starts = row_starts[row_starts < last_start]
    at_row = torch.arange(TRAIN_BATCH).unsqueeze(1) % 2 == 0
    for _ in range(TRAIN_STEPS):
        anywhere = torch.randint(0, last_start, (TRAIN_BATCH, 1), generator=generator)
        row = row_starts[torch.randint(0, len(row_starts), (TRAIN_BATCH, 1), generator=generator)]
        starts = torch.where(at_row, row, anywhere)
        window = stream[starts + offsets]
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(
        json.dumps({"final_loss": round(loss.item(), 4), "tokens": len(stream)}, indent=2) + "\n"
    )


def ensure_tiny_target(
    out_dir: str | os.PathLike[str] | None = None, *, samples_dir: Path = SAMPLES_DIR
) -> Path:
    """The tiny target's folder (model + tokenizer), built once per fingerprint and cached.

    ``AutoModelForCausalLM``/``AutoTokenizer`` and ``transformers serve`` load it.
    Without ``out_dir`` the cached folder itself is returned (treat it as read-only).
    """
    return _place(_cached("target", samples_dir, _train_target), out_dir)


def target_command(out: Path) -> int:
    """``eyrie embedded target --out-dir DIR``: the step that puts the tiny target in a run."""
    step_dir = step_dir_from_env()
    started = time.monotonic()
    folder = ensure_tiny_target(out)
    training = json.loads((folder / "training.json").read_text())
    write_manifest(
        step_dir,
        [os.path.relpath(folder.resolve(), step_dir.resolve())],
        stats={"seconds": round(time.monotonic() - started, 2), **training},
    )
    print(f"tiny target ready in {folder}")
    return 0


# ---------------------------------------------------------------- self-distilled data

DISTILL_PROMPT_TOKENS = 160
DISTILL_NEW_TOKENS = 96
DISTILL_BATCH = 32


def _distill(out: Path, samples_dir: Path) -> None:
    """The target's own greedy answers to the sample prompts, as tokenized training shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_tiny_target(samples_dir=samples_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts, seen = [], set()
    for conversation in sample_conversations(samples_dir):
        first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
        if not first:
            continue
        ids = tokenizer.apply_chat_template(
            conversation[:first], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = list(ids)[-DISTILL_PROMPT_TOKENS:]
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            prompts.append(ids)
    rows = {"input_ids": [], "loss_mask": [], "source": []}
    with torch.no_grad():
        for start in range(0, len(prompts), DISTILL_BATCH):
            batch_prompts = prompts[start : start + DISTILL_BATCH]
            batch = tokenizer.pad({"input_ids": batch_prompts}, return_tensors="pt")
            out_ids = model.generate(**batch, max_new_tokens=DISTILL_NEW_TOKENS, do_sample=False)
            width = batch["input_ids"].shape[1]
            for prompt, row in zip(batch_prompts, out_ids[:, width:], strict=True):
                answer = row.tolist()
                if tokenizer.eos_token_id in answer:
                    answer = answer[: answer.index(tokenizer.eos_token_id) + 1]
                answer = [t for t in answer if t != tokenizer.pad_token_id]
                rows["input_ids"].append(prompt + answer)
                rows["loss_mask"].append([0] * len(prompt) + [1] * len(answer))
                rows["source"].append("tiny-target-greedy")
    pq.write_table(pa.table(rows), out / "shard-00000.parquet")


def ensure_distilled_shards(
    out_dir: str | os.PathLike[str] | None = None, *, samples_dir: Path = SAMPLES_DIR
) -> Path:
    """A folder of tokenized shards (``input_ids``, ``loss_mask``, ``source``) whose answers the
    tiny target generated itself (greedy): data a draft can learn to predict. Cached."""
    return _place(_cached("distill", samples_dir, _distill), out_dir)
