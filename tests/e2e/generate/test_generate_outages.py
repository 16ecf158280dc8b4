"""Server outages and broken servers: no prompt is lost, and a server that only fails stops the step."""

from __future__ import annotations

import threading
import time

import pytest
from generate_helpers import FakeServer, fake_servers, read_jsonl, run_generate, simple_prompts

from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.step import read_manifest, service_urls_path
from pipeline.steps.serving.step_server import free_port

ALL_IDS = [f"p{i:05d}" for i in range(600)]


@pytest.fixture
def fake_server():
    yield from fake_servers()


def ids_of(path):
    return [row["id"] for row in read_jsonl(path)]


def test_an_outage_then_a_dead_server_loses_no_prompt(tmp_path, fake_server):
    # The reported scenario, its times shortened: 200 answers, then 500 to every request (its
    # /health still fine) for 3 s, then the server exits. The prompts in flight then used to
    # run out of retries and be recorded as final http_500 errors, never asked again.
    failing = fake_server("--outage-after", "200", "--outage-s", "3", "--outage-then", "exit")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 600)
    out = tmp_path / "out"
    extra = ("--concurrency", "4", "--max-retries", "3", "--health-timeout", "2s")
    result = run_generate(prompts, out, failing.url, extra=extra)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert read_manifest(out) is None
    assert len(ids_of(out / "conversations.partial.jsonl")) == 200
    # Nothing that failed for want of a server is a final answer.
    assert (out / "errors.partial.jsonl").read_text() == ""

    record = tmp_path / "requests.jsonl"
    healthy = fake_server("--record", str(record))
    result = run_generate(prompts, out, healthy.url, extra=("--concurrency", "4"))
    assert result.returncode == 0, result.stderr
    assert "200 already done" in result.stderr
    assert len(read_jsonl(record)) == 400  # every prompt without an answer was asked again
    assert sorted(ids_of(out / "conversations.jsonl")) == ALL_IDS
    assert (out / "errors.jsonl").read_text() == ""


def test_requests_wait_for_a_restarting_server_without_spending_retries(tmp_path, fake_server):
    port = free_port()
    first = fake_server("--die-after", "100", port=port)
    restarted: list[FakeServer] = []

    def restart_later() -> None:
        first.process.wait()
        time.sleep(2.0)  # nothing listens meanwhile: every request is refused
        restarted.append(fake_server(port=port))

    restarter = threading.Thread(target=restart_later)
    restarter.start()
    try:
        prompts = simple_prompts(tmp_path / "prompts.jsonl", 400)
        out = tmp_path / "out"
        # One retry would not outlast a 2 s outage: only waiting on /health does.
        extra = ("--max-retries", "1", "--concurrency", "8", "--health-timeout", "30s")
        result = run_generate(prompts, out, first.url, extra=extra)
    finally:
        restarter.join()
    assert result.returncode == 0, result.stderr
    assert sorted(ids_of(out / "conversations.jsonl")) == [f"p{i:05d}" for i in range(400)]
    assert (out / "errors.jsonl").read_text() == ""
    assert f"{first.url} stopped answering" in result.stderr and "answers again after" in result.stderr
    attempt = read_manifest(out).stats["this_attempt"]
    assert attempt["outages"] == 1 and attempt["outage_s"] >= 1.5
    assert attempt["retries"] <= 8  # at most the requests in flight when it died


def test_a_service_replica_started_again_elsewhere_is_asked_there(tmp_path, fake_server):
    # A target service's replica dies; the runner starts it again on another port (under Slurm:
    # another node) and writes where it answers now to the run directory. Generate, given the
    # service's URLs by the runner as a step that uses it, asks it there.
    run_dir = tmp_path / "run"
    first = fake_server("--die-after", "100")
    moved: list[FakeServer] = []

    def start_elsewhere() -> None:
        first.process.wait()
        moved.append(fake_server())
        atomic_write_text(service_urls_path(run_dir, "target"), moved[0].url + "\n")

    mover = threading.Thread(target=start_elsewhere)
    mover.start()
    try:
        prompts = simple_prompts(tmp_path / "prompts.jsonl", 400)
        out = tmp_path / "out"
        env = {"EYRIE_RUN_DIR": str(run_dir), "EYRIE_SERVICE_TARGET_URLS": first.url}
        extra = ("--max-retries", "1", "--concurrency", "8", "--health-timeout", "30s")
        result = run_generate(prompts, out, extra=extra, env=env)
    finally:
        mover.join()
    assert result.returncode == 0, result.stderr
    assert sorted(ids_of(out / "conversations.jsonl")) == [f"p{i:05d}" for i in range(400)]
    assert (out / "errors.jsonl").read_text() == ""
    assert f"{first.url} was started again at {moved[0].url}; asking it there" in result.stderr


def test_a_server_that_answers_500_to_everything_stops_the_step(tmp_path, fake_server):
    server = fake_server("--error-rate", "500:1")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 60)
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, extra=("--max-retries", "2"))
    assert result.returncode == 3, result.stderr
    said = result.stderr.strip().splitlines()[-1]
    assert said.startswith(
        "error: stopped, 60 of the last 60 rows failed (100%, above --max-error-rate 0.5; last: "
        "http_500: no answer after 3 attempts: HTTP 500: injected 500); 0/60 rows are done and kept in "
    ), said
    assert read_manifest(out) is None
    assert (out / "errors.partial.jsonl").read_text() == ""  # retryable: a rerun asks them all again


def test_a_server_that_rejects_everything_stops_after_the_window(tmp_path, fake_server):
    server = fake_server("--reject-marker", "question")  # every prompt is a 400
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 600)
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, extra=("--error-window", "50", "--concurrency", "4"))
    assert result.returncode == 3, result.stderr
    said = result.stderr.strip().splitlines()[-1]
    assert "50 of the last 50 rows failed (100%, above --max-error-rate 0.5; last: http_400: " in said
    assert "prompt rejected: contains the reject marker" in said
    assert read_manifest(out) is None
    assert 50 <= len(read_jsonl(out / "errors.partial.jsonl")) < 600

    # The limit is the user's: 1 never stops, and the rejections are the rows' final answers.
    result = run_generate(prompts, out, server.url, extra=("--max-error-rate", "1"))
    assert result.returncode == 0, result.stderr
    assert read_manifest(out).stats["errors_by_kind"] == {"http_400": 600}


def test_a_server_whose_health_fails_too_is_waited_for(tmp_path, fake_server):
    # SGLang answers 503 on /health while it is unwell (and still lists its model): requests wait
    # for it instead of spending their retries on 500s.
    server = fake_server("--outage-after", "100", "--outage-s", "2", "--outage-health")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 300)
    out = tmp_path / "out"
    result = run_generate(prompts, out, server.url, extra=("--max-retries", "1", "--concurrency", "8"))
    assert result.returncode == 0, result.stderr
    assert sorted(ids_of(out / "conversations.jsonl")) == [f"p{i:05d}" for i in range(300)]
    assert (out / "errors.jsonl").read_text() == ""
    attempt = read_manifest(out).stats["this_attempt"]
    assert attempt["outages"] == 1 and attempt["outage_s"] >= 1.5
