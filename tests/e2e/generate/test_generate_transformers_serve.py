"""The embedded default end to end: the tiny target served by the real `transformers serve`."""

from __future__ import annotations

import re
import socket

import pytest
from generate_helpers import read_jsonl, run_generate, write_prompts

from pipeline.contract.step import check_manifest, read_manifest

TOOL_CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
ROWS = [
    {"id": "plain", "source": "t", "messages": [{"role": "user", "content": "Capital of France?"}]},
    {
        "id": "multi",
        "source": "t",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "how are you?"},
            {"role": "assistant", "content": "fine"},
        ],
    },
    {
        "id": "agent",
        "source": "t",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        ],
    },
]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from pipeline.embedded.tiny import ensure_tiny_target

    return ensure_tiny_target(tmp_path_factory.mktemp("target") / "model")


@pytest.mark.parametrize("batching", ["--no-continuous-batching", "--continuous-batching"])
def test_generate_serves_the_tiny_target_and_stops_the_server(tmp_path, tiny_target, batching):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out"
    result = run_generate(
        prompts,
        out,
        extra=(
            "--serve",
            str(tiny_target),
            batching,
            "--mode",
            "all_turns",
            "--max-tokens",
            "16",
            "--seed",
            "7",
            "--concurrency",
            "2",
            "--health-timeout",
            "5m",
        ),
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    rows = {r["id"]: r for r in read_jsonl(out / "conversations.jsonl")}
    assert set(rows) == {"plain", "multi", "agent"}
    for row in rows.values():
        answer = row["conversations"][-1]
        assert answer["role"] == "assistant" and isinstance(answer["content"], str)
        assert row["finish_reason"] in ("stop", "length")
        assert row["usage"]["completion_tokens"] > 0 and row["usage"]["prompt_tokens"] > 0
    # all_turns regenerated both answers of "multi"; the tool row fell back and kept its tool turns.
    assert [m["role"] for m in rows["multi"]["conversations"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert (
        rows["multi"]["conversations"][2]["content"] != "hello"
        or rows["multi"]["usage"]["completion_tokens"] > 16
    )
    assert rows["agent"]["mode"] == "last_turn"
    assert rows["agent"]["conversations"][1]["tool_calls"] == [TOOL_CALL]
    assert rows["agent"]["conversations"][2] == {
        "role": "tool",
        "content": "sunny, 21C",
        "tool_call_id": "c1",
    }
    ok, why = check_manifest(out, ["conversations.jsonl", "errors.jsonl"])
    assert ok, why
    stats = read_manifest(out).stats
    assert stats["model"] == str(tiny_target) and stats["conversations"] == 3
    assert stats["this_attempt"]["requests"] == 4  # plain 1, multi 2, agent 1
    # The server was the step's own: it is gone once the step ends.
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)", result.stderr).group(1))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
