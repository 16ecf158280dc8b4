"""What the report and explain say of a run whose steps ran on a real Slurm cluster's nodes: the
runner's own host says nothing about them, so it is neither sampled nor judged."""

from __future__ import annotations

import pytest
from test_slurm import cluster  # noqa: F401  (the fixture: skips, or fails, without a cluster)

from eyrie_testing import eyrie
from pipeline.run.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

# The seed's incident on a cluster: all the output written, then an abort at teardown.
ABORTS = """
steps:
  - name: prep
    command: [sh, -c, "echo x > out.txt && sleep 2 && kill -ABRT $$"]
    memory: 64MiB
    outputs: [out.txt]
"""


@pytest.mark.usefixtures("cluster")
def test_steps_on_the_nodes_are_not_judged_by_the_runner_s_host(tmp_path):
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(ABORTS)
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), "--executor", "slurm")
    assert result.returncode == 1, result.stdout + result.stderr
    ledger = Ledger(run_dir, create=False)
    run = ledger.latest_run()
    samples = ledger.host_samples(run["run_id"])
    (attempt,) = ledger.attempts()
    ledger.close()
    assert run["host_sampled"] == 0 and samples == []  # nothing of the login node's memory
    assert run["heartbeat_at"] >= run["ended_at"] - 2  # yet the runner beat until the end
    assert attempt.host_mem_total is None
    out = eyrie("explain", "prep", "--run-dir", str(run_dir), check=True).stdout
    assert "Crashed" in out and "SIGABRT" in out, out
    assert "it ran on a node of the cluster (slurm executor" in out, out
    assert "host had" not in out and "was full" not in out, out
    eyrie("report", "--run-dir", str(run_dir), check=True)
    page = (run_dir / "report.html").read_text()
    assert "Host memory: not sampled" in page and 'data-series="host-' not in page
