"""The end of a generation run: every answered row reaches the disk, or no manifest vouches for it."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from rich.console import Console

from pipeline.contract.step import read_manifest
from pipeline.steps.generate import driver
from pipeline.steps.generate.client import Counters
from pipeline.steps.generate.driver import GenerateConfig, Generation, generate, latency_ms
from pipeline.steps.generate.error_window import ErrorWindow


class InstantClient:
    """Answers every chat at once; ``pause_s`` > 0 yields to the event loop before answering."""

    def __init__(self, urls=(), *, pause_s: float = 0.0, **_: object) -> None:
        self.pause_s = pause_s
        self.counters = Counters()

    async def __aenter__(self) -> InstantClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def wait_healthy(self, timeout_s: float) -> None:
        pass

    async def first_model(self) -> str:
        return "instant"

    async def chat(self, body: bytes) -> dict:
        self.counters.requests += 1
        if self.pause_s:
            await asyncio.sleep(self.pause_s)
        message = {"role": "assistant", "content": "answer"}
        return {"choices": [{"message": message, "finish_reason": "stop"}], "usage": {}}


def prompt_rows(n: int) -> list[dict]:
    return [
        {"id": f"p{i}", "source": "t", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)
    ]


def config_for(tmp_path, **overrides) -> GenerateConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(overrides.pop("n", 4))))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return GenerateConfig(prompts=prompts, out_dir=out, urls=["http://unused"], **overrides)


def run_generation(config: GenerateConfig, client: InstantClient, n: int) -> None:
    generation = Generation(config, client, "instant", n)
    asyncio.run(generation.run(iter(prompt_rows(n)), n, 0, Console(quiet=True)))


def written_ids(config: GenerateConfig) -> list[str]:
    path = config.out_dir / "conversations.partial.jsonl"
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.mark.timeout(30)
def test_run_ends_when_the_last_row_fires_the_flush_trigger(tmp_path):
    # The last row fills the buffer to flush_rows: the flusher is woken at the moment the run
    # stops it. A cancel sent then was swallowed by wait_for (Python 3.11) and the run hung.
    config = config_for(tmp_path, n=4, flush_rows=4, flush_interval_s=60.0, concurrency=1)
    run_generation(config, InstantClient(), 4)
    assert sorted(written_ids(config)) == ["p0", "p1", "p2", "p3"]


@pytest.mark.timeout(30)
def test_rows_being_written_when_the_run_ends_reach_the_file(tmp_path, monkeypatch):
    # The first batch's write is still in its thread when the last row is answered: the run
    # must wait for it, not close the files under it.
    config = config_for(tmp_path, n=5, flush_rows=2, flush_interval_s=60.0, concurrency=1)
    write = Generation._write
    calls = []

    def slow_first_write(self, conv, err):
        calls.append(len(conv))
        if len(calls) == 1:
            time.sleep(1.0)  # the other rows are answered meanwhile
        write(self, conv, err)

    monkeypatch.setattr(Generation, "_write", slow_first_write)
    run_generation(config, InstantClient(pause_s=0.01), 5)
    assert sorted(written_ids(config)) == ["p0", "p1", "p2", "p3", "p4"]


def test_no_manifest_when_rows_went_missing(tmp_path, monkeypatch):
    config = config_for(tmp_path, n=6, flush_rows=512)
    monkeypatch.setattr(driver, "ChatClient", InstantClient)
    write = Generation._write

    def losing_write(self, conv, err):
        write(self, conv[1:], err)  # a fault that drops a row on its way to disk

    monkeypatch.setattr(Generation, "_write", losing_write)
    console = Console(record=True, width=200)
    assert generate(config, console) == driver.EXIT_ROWS_MISSING
    assert "1 of 6 prompts have no row" in console.export_text()
    assert read_manifest(config.out_dir) is None

    # A rerun asks only for the lost row and completes the step.
    monkeypatch.setattr(Generation, "_write", write)
    assert generate(config, Console(quiet=True)) == 0
    assert read_manifest(config.out_dir).stats["conversations"] == 6


def test_the_error_window_judges_only_a_full_window_and_slides():
    window = ErrorWindow(size=4, limit=0.5, rows_to_do=100)
    assert [window.add(True) for _ in range(3)] == [False, False, False]  # not full yet
    assert window.add(True)  # 4 of 4
    window = ErrorWindow(size=4, limit=0.5, rows_to_do=100)
    outcomes = [True, True, False, False, True, False, True, True]
    # Failures in the last four: -, -, -, 2, 2, 2, 2, 3 -> only the last is above half.
    assert [window.add(failed) for failed in outcomes] == [False] * 7 + [True]
    # A run shorter than the window is judged once all its rows have ended.
    window = ErrorWindow(size=200, limit=0.5, rows_to_do=3)
    assert [window.add(True) for _ in range(3)] == [False, False, True]
    # A limit of 1 never stops.
    window = ErrorWindow(size=2, limit=1.0, rows_to_do=10)
    assert not any(window.add(True) for _ in range(10))


def test_latency_percentiles_match_numpy():
    numpy = pytest.importorskip("numpy")
    seconds = [0.001 * (i % 97) + 0.0001 * i for i in range(1000)]
    got = latency_ms(seconds)
    ms = numpy.array(seconds) * 1000
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert got[name] == pytest.approx(numpy.percentile(ms, q), abs=1e-3)
    assert got["mean"] == pytest.approx(ms.mean(), abs=1e-3) and got["max"] == pytest.approx(ms.max())
    assert latency_ms([0.25]) == {"mean": 250.0, "p50": 250.0, "p90": 250.0, "p99": 250.0, "max": 250.0}
    assert latency_ms([]) is None
