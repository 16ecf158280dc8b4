"""A conversation the chat template cannot split into spans stops the step with one line that names
its FILE:LINE, as every other bad record does, not only the template."""

from __future__ import annotations

import json
import subprocess
import sys

from eyrie_testing import REPO

# No generation markers, and a default system header before a first message that is not a system
# one (as SmolLM2's template has): a conversation that opens with an answer renders its prefix
# through that answer with the header, but the prefix before it (nothing, plus the generation
# prompt) without it.
HEADER_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m.role != 'system' %}SYS|{% endif %}"
    "{{ m.role }}:{{ m.content }}|{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_conversation_whose_prefixes_render_otherwise_is_named_by_file_and_line(tiny_tokenizer, tmp_path):
    template = tmp_path / "header.jinja"
    template.write_text(HEADER_TEMPLATE)
    asked = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    opened_by_an_answer = [{"role": "assistant", "content": "ready"}, *asked]
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text(
        "".join(json.dumps({"conversations": c}) + "\n" for c in [asked, opened_by_an_answer, asked])
    )
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "tokenize",
        "--tokenizer",
        str(tiny_tokenizer),
        "--conversations",
        str(conversations),
        "--chat-template",
        str(template),
        "--out-dir",
        str(tmp_path / "out"),
        "--workers",
        "1",
    ]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout
    said = " ".join(result.stdout.split() + result.stderr.split())
    assert f"error: {conversations}:2: chat template" in said, said
    assert "renders a conversation's prefixes differently from the whole" in said
    assert "Traceback" not in said
    assert not (tmp_path / "out" / "shards").exists()
