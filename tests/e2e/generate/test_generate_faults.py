"""The generation step over real HTTP against a fake server that misbehaves on demand."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
from generate_helpers import (
    FakeServer,
    fake_servers,
    read_jsonl,
    run_generate,
    simple_prompts,
    write_prompts,
)

from pipeline.contract.step import check_manifest, read_manifest


@pytest.fixture
def fake_server():
    yield from fake_servers()


def ids_of(path):
    return [row["id"] for row in read_jsonl(path)]


def test_transient_faults_are_retried_and_every_row_lands_once(tmp_path, fake_server):
    server = fake_server(
        "--error-rate",
        "500:0.1",
        "--error-rate",
        "503:0.05",
        "--error-rate",
        "429:0.05",
        "--drop-rate",
        "0.05",
        "--slow-rate",
        "0.02",
        "--slow-s",
        "2",
    )
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 600)
    out = tmp_path / "out"
    # About 27% of requests fail: with the default 6 retries one of 600 rows runs out of them in
    # about 6% of runs (600 x 0.27^7) and is rightly left unanswered; 12 make that 600 x 0.27^13.
    extra = ("--concurrency", "16", "--request-timeout", "1s", "--max-retries", "12")
    result = run_generate(prompts, out, server.url, extra=extra)
    assert result.returncode == 0, result.stderr
    ids = ids_of(out / "conversations.jsonl")
    assert sorted(ids) == [f"p{i:05d}" for i in range(600)]
    assert (out / "errors.jsonl").read_text() == ""
    ok, why = check_manifest(out, ["conversations.jsonl", "errors.jsonl"])
    assert ok, why
    attempt = read_manifest(out).stats["this_attempt"]
    # Every kind of injected fault happened and was retried, not recorded as an error.
    assert {"http_500", "http_503", "http_429", "disconnected", "timeout"} <= set(attempt["transient"])
    assert attempt["retries"] == sum(attempt["transient"].values())
    assert attempt["requests"] == 600 + attempt["retries"]
    assert "Traceback" not in result.stderr


def test_a_run_whose_last_row_fills_a_flush_batch_ends(tmp_path, fake_server):
    # 512 rows = one full flush batch at the very end: the step used to hang there, rows on disk.
    server = fake_server()
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 512)
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(ids_of(out / "conversations.jsonl")) == 512
    assert read_manifest(out).stats["conversations"] == 512


def test_permanent_errors_go_to_errors_jsonl_and_truncated_rows_are_flagged(tmp_path, fake_server):
    server = fake_server("--reasoning")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 100, marker_every={"REJECT-ME": 10, "CUT-ME": 7})
    out = tmp_path / "out"
    assert run_generate(prompts, out, server.url).returncode == 0
    errors = read_jsonl(out / "errors.jsonl")
    assert sorted(e["id"] for e in errors) == [f"p{i:05d}" for i in range(0, 100, 10)]
    assert all(e["kind"] == "http_400" and "reject marker" in e["reason"] for e in errors)
    rows = {r["id"]: r for r in read_jsonl(out / "conversations.jsonl")}
    assert len(rows) == 90
    truncated = {i for i, r in rows.items() if r["truncated"]}
    assert truncated == {f"p{i:05d}" for i in range(100) if i % 7 == 0 and i % 10 != 0}
    assert all(r["conversations"][-1]["reasoning_content"].startswith("thinking") for r in rows.values())
    stats = read_manifest(out).stats
    assert stats["errors_by_kind"] == {"http_400": 10}
    assert stats["truncated"] == len(truncated) and stats["conversations"] == 90

    # Dropping truncated rows instead: they move to errors.jsonl (other settings: --restart).
    assert run_generate(prompts, out, server.url, extra=("--drop-truncated", "--restart")).returncode == 0
    kinds = Counter(e["kind"] for e in read_jsonl(out / "errors.jsonl"))
    assert kinds == {"http_400": 10, "truncated": len(truncated)}
    assert len(read_jsonl(out / "conversations.jsonl")) == 90 - len(truncated)


def test_request_carries_sampling_template_kwargs_tools_and_per_row_seed(tmp_path, fake_server):
    record = tmp_path / "requests.jsonl"
    server = fake_server("--record", str(record))
    tool_call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    rows = [
        {
            "id": "agent",
            "source": "t",
            "tools": [{"type": "function", "function": {"name": "lookup"}}],
            "messages": [
                {"role": "user", "content": "look it up"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "c1", "content": "found"},
                {"role": "assistant", "content": "old answer"},
            ],
        },
        {
            "id": "chat",
            "source": "t",
            "messages": [
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
            ],
        },
    ]
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out"
    extra = (
        "--mode",
        "all_turns",
        "--temperature",
        "0.3",
        "--top-p",
        "0.9",
        "--max-tokens",
        "77",
        "--seed",
        "5",
        "--chat-template-kwargs",
        '{"enable_thinking": true}',
    )
    result = run_generate(prompts, out, server.url, extra=extra)
    assert result.returncode == 0, result.stderr
    sent = read_jsonl(record)
    assert len(sent) == 3  # agent: one (fell back to last_turn); chat: two turns
    for body in sent:
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.3, 0.9, 77)
        assert body["chat_template_kwargs"] == {"enable_thinking": True}
        assert body["model"] == "fake-target"
    agent = next(b for b in sent if b.get("tools"))
    assert [m["role"] for m in agent["messages"]] == ["user", "assistant", "tool"]
    assert agent["messages"][1]["tool_calls"] == [tool_call]
    assert agent["messages"][2]["tool_call_id"] == "c1"
    chat = [b for b in sent if not b.get("tools")]
    assert len({b["seed"] for b in chat}) == 1 and chat[0]["seed"] != agent["seed"]
    # The second turn is asked with the regenerated first answer, not the source's "a1".
    assert chat[1]["messages"][1]["content"].startswith("answer-")
    stats = read_manifest(out).stats
    assert stats["fallback_last_turn"] == 1
    out_rows = {r["id"]: r for r in read_jsonl(out / "conversations.jsonl")}
    assert out_rows["agent"]["mode"] == "last_turn" and out_rows["chat"]["mode"] == "all_turns"
    assert len(out_rows["chat"]["conversations"]) == 4


def test_dead_server_stops_cleanly_and_a_rerun_completes_exactly_once(tmp_path, fake_server):
    dying = fake_server("--die-after", "150")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 400)
    out = tmp_path / "out"
    result = run_generate(prompts, out, dying.url, extra=("--max-retries", "3", "--health-timeout", "2s"))
    assert result.returncode == 3, result.stderr
    assert f"no server answers any more ({dying.url} gave no answer for 2s" in result.stderr
    assert "rerun to resume" in result.stderr
    assert "Traceback" not in result.stderr
    assert read_manifest(out) is None  # nothing looks complete
    assert not (out / "conversations.jsonl").exists()
    kept = ids_of(out / "conversations.partial.jsonl")
    assert 0 < len(kept) <= 150 and len(set(kept)) == len(kept)

    record = tmp_path / "requests.jsonl"
    healthy = fake_server("--record", str(record))
    result = run_generate(prompts, out, healthy.url)
    assert result.returncode == 0, result.stderr
    assert f"{len(kept)} already done" in result.stderr
    assert len(read_jsonl(record)) == 400 - len(kept)  # the rerun asked only for the rest
    ids = ids_of(out / "conversations.jsonl")
    assert sorted(ids) == [f"p{i:05d}" for i in range(400)]


def test_requests_spread_over_several_servers_and_survive_one_dying(tmp_path, fake_server):
    rec_a, rec_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = fake_server("--record", str(rec_a), "--slow-rate", "1", "--slow-s", "0.02")
    b = fake_server("--record", str(rec_b), "--die-after", "40", "--slow-rate", "1", "--slow-s", "0.02")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 300)
    out = tmp_path / "out"
    result = run_generate(prompts, out, a.url, b.url, extra=("--max-retries", "2", "--concurrency", "8"))
    assert result.returncode == 0, result.stderr
    assert sorted(ids_of(out / "conversations.jsonl")) == [f"p{i:05d}" for i in range(300)]
    assert len(read_jsonl(rec_b)) >= 40 and len(read_jsonl(rec_a)) >= 150


def test_health_wait_reports_the_url_or_waits_for_a_late_server(tmp_path):
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 5)
    from pipeline.steps.serving.step_server import free_port

    port = free_port()
    result = run_generate(
        prompts, tmp_path / "out", f"http://127.0.0.1:{port}", extra=("--health-timeout", "2s")
    )
    assert result.returncode == 3
    assert f"server http://127.0.0.1:{port} was not healthy after 2s" in result.stderr

    # A server that comes up while the step waits is used.
    late: list[FakeServer] = []
    timer = threading.Timer(2.0, lambda: late.append(FakeServer(port=port)))
    timer.start()
    try:
        started = time.monotonic()
        result = run_generate(prompts, tmp_path / "out", f"http://127.0.0.1:{port}")
        assert result.returncode == 0, result.stderr
        assert time.monotonic() - started >= 2.0
    finally:
        timer.join()
        for server in late:
            server.kill()


def test_api_key_from_env_or_file_is_sent_and_never_written(tmp_path, fake_server):
    secret = "sk-test-0123456789abcdef"
    server = fake_server("--api-key", secret)
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 20)
    denied = run_generate(
        prompts, tmp_path / "denied", server.url, extra=("--health-timeout", "5s"), env={"OPENAI_API_KEY": ""}
    )
    assert denied.returncode != 0 and "API key" in denied.stderr

    by_env = run_generate(prompts, tmp_path / "env", server.url, env={"OPENAI_API_KEY": secret})
    assert by_env.returncode == 0, by_env.stderr
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    by_file = run_generate(
        prompts,
        tmp_path / "file",
        server.url,
        extra=("--api-key-file", str(key_file)),
        env={"OPENAI_API_KEY": ""},
    )
    assert by_file.returncode == 0, by_file.stderr
    for result in (denied, by_env, by_file):
        assert secret not in result.stdout + result.stderr
    for folder in ("env", "file"):
        for path in (tmp_path / folder).iterdir():
            assert secret not in path.read_text(), path


def test_changed_prompts_and_retry_errors(tmp_path, fake_server):
    server = fake_server()
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 30, marker_every={"REJECT-ME": 3})
    out = tmp_path / "out"
    assert run_generate(prompts, out, server.url).returncode == 0
    assert len(read_jsonl(out / "errors.jsonl")) == 10

    # Rows no longer in the prompts leave the output for not-in-prompts/, kept; done rows are not
    # asked again.
    answered = {row["id"]: row for row in read_jsonl(out / "conversations.jsonl")}
    gone = [row["id"] for row in read_jsonl(prompts)[:5] if row["id"] in answered]
    rows = read_jsonl(prompts)[5:]
    for row in rows:
        row["messages"][0]["content"] = row["messages"][0]["content"].replace(" REJECT-ME", "")
    write_prompts(prompts, rows)
    record = tmp_path / "requests.jsonl"
    server2 = fake_server("--record", str(record))
    result = run_generate(prompts, out, server2.url, extra=("--retry-errors",))
    assert result.returncode == 0, result.stderr
    # Only the ids that had failed (and are still wanted) were asked again; now they succeed.
    assert len(read_jsonl(record)) == 8
    assert sorted(ids_of(out / "conversations.jsonl")) == [r["id"] for r in rows]
    assert (out / "errors.jsonl").read_text() == ""
    assert read_manifest(out).stats["not_in_prompts"] == len(gone) == 3
    kept = read_jsonl(out / "not-in-prompts" / "conversations.jsonl")
    assert sorted(kept, key=lambda row: row["id"]) == sorted(
        (answered[i] for i in gone), key=lambda row: row["id"]
    )


def test_bad_input_is_one_clear_line(tmp_path, fake_server):
    server = fake_server()
    missing = run_generate(tmp_path / "nope.jsonl", tmp_path / "out", server.url)
    assert missing.returncode == 2 and "run the prep step first" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "messages": []}) + "\n{broken\n")
    result = run_generate(bad, tmp_path / "out", server.url)
    assert result.returncode == 2 and "bad.jsonl:2" in result.stderr
    assert "Traceback" not in result.stderr


def test_server_url_from_the_environment_as_in_the_compose_pipeline(tmp_path, fake_server):
    server = fake_server()
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 10)
    result = run_generate(prompts, tmp_path / "out", env={"EYRIE_TARGET_URL": server.url})
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "out" / "conversations.jsonl")) == 10
    neither = run_generate(prompts, tmp_path / "out2", env={"EYRIE_TARGET_URL": ""})
    assert neither.returncode == 2
    assert "--url or $EYRIE_TARGET_URL (or a `target` service the step uses), or a model" in neither.stderr


def test_rows_that_cannot_be_asked_are_errors_not_crashes(tmp_path, fake_server):
    server = fake_server()
    rows = [
        {"id": "empty", "source": "t", "messages": []},
        {"id": "odd-role", "source": "t", "messages": [{"role": "narrator", "content": "x"}]},
        {"id": "fine", "source": "t", "messages": [{"role": "user", "content": "q"}]},
    ]
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    result = run_generate(prompts, tmp_path / "out", server.url)
    assert result.returncode == 0, result.stderr
    errors = {e["id"]: e for e in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert set(errors) == {"empty", "odd-role"} and {e["kind"] for e in errors.values()} == {"bad_prompt"}
    assert ids_of(tmp_path / "out" / "conversations.jsonl") == ["fine"]


def test_a_rerun_with_other_settings_refuses_and_restart_moves_the_old_rows_aside(tmp_path, fake_server):
    server = fake_server()
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 50)
    out = tmp_path / "out"
    assert run_generate(prompts, out, server.url).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    refused = run_generate(prompts, out, server.url, extra=("--temperature", "0.5"))
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"error: the rows in {out} were made with other settings (sampling.temperature 0.7 -> 0.5); "
        "rerun with the same settings to resume them, or add --restart (in a pipeline file's run: "
        "EYRIE_GENERATE_RESTART=1, once) to move them aside and start over"
    )
    # Refused before touching anything: the earlier outputs still check out as complete.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert check_manifest(out, ["conversations.jsonl", "errors.jsonl"])[0]

    # The model name from /v1/models changed behind a router: the same refusal.
    other = fake_server("--model", "other-target")
    refused = run_generate(prompts, out, other.url)
    assert refused.returncode == 2 and "model 'fake-target' -> 'other-target'" in refused.stderr

    restarted = run_generate(prompts, out, server.url, extra=("--temperature", "0.5", "--restart"))
    assert restarted.returncode == 0, restarted.stderr
    (aside,) = (out / "restarted").iterdir()
    assert f"--restart: the earlier rows are kept in {aside}" in restarted.stderr
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert json.loads((aside / "generate.settings.json").read_text())["sampling"]["temperature"] == 0.7
    assert len(read_jsonl(out / "conversations.jsonl")) == 50
    assert read_manifest(out).stats["sampling"]["temperature"] == 0.5

    # In a pipeline the command is the file's: the restart comes from the environment, for one run.
    again = run_generate(prompts, out, other.url, env={"EYRIE_GENERATE_RESTART": "1"})
    assert again.returncode == 0, again.stderr
    assert len(list((out / "restarted").iterdir())) == 2


def test_a_200_without_a_completion_is_retried_and_never_a_final_answer(tmp_path, fake_server):
    record = tmp_path / "requests.jsonl"
    server = fake_server("--hollow-rate", "0.2", "--record", str(record))
    rows = [
        {"id": f"p{i:03d}", "source": "t", "messages": [{"role": "user", "content": "q"}]} for i in range(60)
    ]
    rows.append({"id": "hollow", "source": "t", "messages": [{"role": "user", "content": "HOLLOW"}]})
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, extra=("--max-retries", "6", "--retry-base", "0.01"))
    # The row that only ever gets hollow answers is left unanswered: exit 3, no manifest.
    assert result.returncode == 3, result.stderr
    assert "1 prompts got no usable answer" in result.stderr and "bad_response: 1" in result.stderr
    assert read_manifest(out) is None
    assert "hollow" not in (out / "errors.partial.jsonl").read_text()
    done = ids_of(out / "conversations.partial.jsonl")
    assert sorted(done) == [f"p{i:03d}" for i in range(60)]  # every hollow answer among them retried
    asked = Counter(json.loads(line)["messages"][0]["content"] for line in record.read_text().splitlines())
    assert asked["HOLLOW"] == 7 and asked["q"] > 60, asked

    again = run_generate(prompts, out, server.url, extra=("--max-retries", "0"))
    assert again.returncode == 3 and "60 already done; 1 to go" in again.stderr, again.stderr
    asked = Counter(json.loads(line)["messages"][0]["content"] for line in record.read_text().splitlines())
    assert asked["HOLLOW"] == 8  # asked again: a hollow answer was never recorded as final


def _not_unicode_rows():
    return [
        # json.dumps writes the lone surrogate as the escape \ud800: valid JSON, not valid Unicode.
        {"id": "lone", "source": "t", "messages": [{"role": "user", "content": "lone \ud800 surrogate"}]},
        {"id": "answer", "source": "t", "messages": [{"role": "user", "content": "say BAD-UNICODE"}]},
        *({"id": f"ok{i}", "source": "t", "messages": [{"role": "user", "content": "q"}]} for i in range(8)),
    ]


def test_text_that_is_not_unicode_is_a_row_error_not_a_crash(tmp_path, fake_server):
    record = tmp_path / "requests.jsonl"
    server = fake_server("--record", str(record))
    prompts = write_prompts(tmp_path / "prompts.jsonl", _not_unicode_rows())
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, extra=("--seed", "7"))  # the same answer if asked again
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    errors = {e["id"]: e for e in read_jsonl(out / "errors.jsonl")}
    assert errors["lone"]["kind"] == "bad_prompt"
    assert "not valid Unicode text: lone surrogate U+D800 after" in errors["lone"]["reason"]
    assert errors["answer"]["kind"] == "bad_response"
    assert "the answer is not valid Unicode text: lone surrogate U+D800" in errors["answer"]["reason"]
    assert sorted(ids_of(out / "conversations.jsonl")) == [f"ok{i}" for i in range(8)]
    # The prompt that cannot be sent was not; the server's bad answer was asked for once.
    assert len(read_jsonl(record)) == 9

    again = run_generate(prompts, out, server.url, extra=("--seed", "7"))
    assert again.returncode == 0, again.stderr
    assert "10 already done; 0 to go" in again.stderr


def test_an_answer_that_is_not_unicode_from_random_sampling_is_asked_again(tmp_path, fake_server):
    server = fake_server()
    prompts = write_prompts(tmp_path / "prompts.jsonl", _not_unicode_rows())
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url)  # temperature 0.7, no seed: another draw may be fine
    assert result.returncode == 3, result.stderr
    assert "1 prompts got no usable answer" in result.stderr and "bad_response: 1" in result.stderr
    assert "Traceback" not in result.stderr
    errors = {e["id"]: e["kind"] for e in read_jsonl(out / "errors.partial.jsonl")}
    assert errors == {"lone": "bad_prompt"}  # the prompt's fault is final; the answer's is not
    again = run_generate(prompts, out, server.url)
    assert again.returncode == 3 and "9 already done; 1 to go" in again.stderr, again.stderr


def test_request_latency_percentiles_are_in_the_manifest(tmp_path, fake_server):
    server = fake_server("--slow-rate", "1", "--slow-s", "0.05")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 40)
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, extra=("--concurrency", "4"))
    assert result.returncode == 0, result.stderr
    latency = read_manifest(out).stats["this_attempt"]["e2e_latency_ms"]
    assert set(latency) == {"mean", "p50", "p90", "p99", "max"}
    assert 50 <= latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert 50 <= latency["mean"] <= latency["max"]
    assert f"latency p50 {latency['p50']:.0f} ms, p99 {latency['p99']:.0f} ms" in result.stderr


def test_a_parsed_answer_keeps_its_reasoning_and_tool_calls(tmp_path, fake_server):
    """A server that splits its answers (SGLang's --reasoning-parser and --tool-call-parser, as
    the real job serves Kimi-K2.5): the reasoning and the tool calls land in the conversation."""
    record = tmp_path / "requests.jsonl"
    server = fake_server("--reasoning", "--record", str(record))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    rows = [
        {
            "id": "agent",
            "source": "t",
            "tools": tools,
            "messages": [{"role": "user", "content": "find x CALL-A-TOOL"}],
        }
    ]
    out = tmp_path / "out"
    result = run_generate(write_prompts(tmp_path / "prompts.jsonl", rows), out, server.url)
    assert result.returncode == 0, result.stderr
    assert read_jsonl(record)[0]["tools"] == tools  # the server parses tool calls only when offered tools
    (row,) = read_jsonl(out / "conversations.jsonl")
    answer = row["conversations"][-1]
    assert answer["role"] == "assistant" and answer["content"].startswith("answer-")
    assert answer["reasoning_content"].startswith("thinking about ")
    call = {"name": "lookup", "arguments": json.dumps({"q": "x"})}
    assert answer["tool_calls"] == [{"id": "call_1", "type": "function", "function": call}]
    assert row["finish_reason"] == "tool_calls"
