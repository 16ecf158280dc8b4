"""The host's memory is recorded for a run's whole life, not only inside its steps."""

from __future__ import annotations

import sqlite3
import time

import pytest

from eyrie_testing import eyrie
from pipeline.memory import memory_budget, read_meminfo
from pipeline.run.host_sampler import HostSampler
from pipeline.run.ledger import Ledger


def test_the_sampler_keeps_one_row_a_second_of_what_the_host_really_has(tmp_path):
    ledger = Ledger(tmp_path)
    started = time.time()
    sampler = HostSampler(ledger, "r1", memory_budget).start()
    time.sleep(2.3)
    sampler.stop()
    samples = ledger.host_samples("r1")
    ledger.close()
    assert 3 <= len(samples) <= 5, samples  # the first moment, one a second, the last (partial) second
    assert started <= samples[0].t <= started + 0.5 and samples[-1].t >= started + 2.2
    assert all(b.t - a.t <= 1.3 for a, b in zip(samples, samples[1:], strict=False))
    meminfo = read_meminfo()
    for sample in samples:
        assert sample.mem_total == meminfo["MemTotal"]
        assert 0 < sample.available <= sample.mem_available <= sample.mem_total
        assert sample.in_use == sample.mem_total - sample.mem_available
        assert abs(sample.mem_available - meminfo["MemAvailable"]) < meminfo["MemTotal"] // 4


def test_a_sample_that_cannot_be_written_is_skipped_and_sampling_goes_on(tmp_path, monkeypatch):
    ledger = Ledger(tmp_path)
    written = ledger.add_host_sample
    failures = []

    def busy_once(run_id, sample):
        if not failures:
            failures.append(sample)
            raise sqlite3.OperationalError("database is locked")
        written(run_id, sample)

    monkeypatch.setattr(ledger, "add_host_sample", busy_once)
    sampler = HostSampler(ledger, "r1", memory_budget).start()  # its first row fails
    time.sleep(1.2)
    sampler.stop()
    assert failures and len(ledger.host_samples("r1")) >= 1
    ledger.close()


def test_without_a_view_of_the_steps_memory_the_sampler_writes_a_heartbeat_a_second(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.start_run("r1", "p.yaml", "slurm", [], None, None, host_sampled=False)
    started = time.time()
    sampler = HostSampler(ledger, "r1", None).start()
    time.sleep(1.3)
    first = ledger.last_seen("r1")
    time.sleep(1.0)
    sampler.stop()
    last = ledger.last_seen("r1")
    assert ledger.host_samples("r1") == []  # nothing on this host tells the nodes' memory
    assert ledger.latest_run()["host_sampled"] == 0
    ledger.close()
    assert started <= first < last and last - first >= 0.9, (started, first, last)


@pytest.mark.usefixtures("real_cgroups")
def test_a_run_records_the_host_from_its_start_to_its_end(tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("steps:\n  - name: nap\n    command: [sleep, '2']\n    memory: 64MiB\n")
    eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"), check=True)
    ledger = Ledger(tmp_path / "run", create=False)
    run = ledger.latest_run()
    samples = ledger.host_samples(run["run_id"])
    ledger.close()
    assert len(samples) >= 3
    assert samples[0].t - run["started_at"] < 0.5 and run["ended_at"] - samples[-1].t < 0.5
