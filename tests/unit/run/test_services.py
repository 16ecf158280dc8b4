"""Services under the local executor, for real: replicas in cgroups of their own, health checked
over HTTP, recorded in the ledger beside the steps, stopped after their last user."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from eyrie_testing import REPO, eyrie
from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.step import service_urls_path
from pipeline.run.cli import ConsoleReporter
from pipeline.run.ledger import Ledger
from pipeline.run.local import LocalExecutor
from pipeline.run.orchestrator import Orchestrator
from pipeline.run.spec import PipelineError, load_pipeline

SERVER = str(REPO / "tests" / "scenarios" / "server.py")
SCENARIO = str(REPO / "tests" / "scenarios" / "scenario.py")
# A user of `web`: asks each replica for its pid, then prints them.
ASK_EACH = (
    "import json, os, urllib.request\n"
    "urls = os.environ['EYRIE_SERVICE_WEB_URLS'].split(',')\n"
    "print('pids', [json.load(urllib.request.urlopen(u + '/'))['pid'] for u in urls])\n"
)


def web(**overrides) -> dict:
    return {
        "name": "web",
        "command": [sys.executable, SERVER, "${EYRIE_SERVICE_PORT}"],
        "memory": "128MiB",
        "startup_timeout": "60s",
        **overrides,
    }


def pipeline(tmp_path: Path, services: list[dict], steps: list[dict]) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "services", "services": services, "steps": steps}))
    return path


def attempts(run_dir: Path) -> dict[str, list]:
    ledger = Ledger(run_dir, create=False)
    try:
        found: dict[str, list] = {}
        for row in ledger.attempts():
            found.setdefault(row.label, []).append(row)
        return found
    finally:
        ledger.close()


def test_a_service_starts_before_its_user_serves_it_from_every_replica_and_stops_after(
    tmp_path, real_cgroups
):
    user = {"name": "ask", "command": [sys.executable, "-c", ASK_EACH], "memory": "64MiB", "uses": ["web"]}
    after = {"name": "after", "command": ["true"], "memory": "16MiB", "needs": ["ask"]}
    path = pipeline(tmp_path, [web(replicas=2)], [user, after])
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr

    rows = attempts(tmp_path / "run")
    replicas = rows["web[1]"] + rows["web[2]"]
    assert [r.verdict for r in replicas] == ["succeeded", "succeeded"]
    assert {r.replica for r in replicas} == {1, 2}
    assert all(r.limit_bytes == 128 * 1024 * 1024 and r.peak_bytes for r in replicas)  # its own cgroup
    (ask,) = rows["ask"]
    assert all(r.started_at < ask.started_at and r.ended_at >= ask.ended_at for r in replicas)
    # Each replica answered the user, at the URL the runner gave it.
    pids = json.loads(next(line for line in result.stdout.splitlines() if "pids" in line).split("pids", 1)[1])
    assert sorted(pids) == sorted(r.pid for r in replicas)
    status = eyrie("status", "--run-dir", str(tmp_path / "run"), check=True).stdout
    assert "web[1]" in status and "web[2]" in status
    # The report's host panel draws the service's memory in a colour of its own.
    eyrie("report", "--run-dir", str(tmp_path / "run"), check=True)
    page = (tmp_path / "run" / "report.html").read_text()
    fills = dict(re.findall(r'data-series="host-([^"]+)" d="[^"]*" fill="([^"]+)"', page))
    assert "web" in fills and fills["web"] != fills.get("ask")


def test_a_service_oom_killed_at_start_is_oom_killed_and_its_user_fails_naming_it(tmp_path, real_cgroups):
    oom = web(command=[sys.executable, SCENARIO, "oom"], memory="64MiB", retries=0)
    user = {"name": "ask", "command": [sys.executable, "-c", ASK_EACH], "memory": "64MiB", "uses": ["web"]}
    path = pipeline(tmp_path, [oom], [user])
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1, result.stdout + result.stderr

    rows = attempts(tmp_path / "run")
    (replica,) = rows["web[1]"]
    assert replica.verdict == "oom_killed"
    assert replica.oom_kills >= 1 and replica.peak_bytes > 32 * 1024 * 1024
    assert "ask" not in rows  # its user never started
    failed = [line for line in result.stdout.splitlines() if "the service failed" in line]
    assert len(failed) == 1 and "web" in failed[0] and "oom_killed" in failed[0], result.stdout
    ledger = Ledger(tmp_path / "run", create=False)
    try:
        state = ledger.step_states(ledger.latest_run()["run_id"])["ask"]
    finally:
        ledger.close()
    assert state["state"] == "failed" and "its service web failed: web[1] oom_killed" in state["detail"]


def test_a_replica_killed_while_in_use_is_started_again_on_its_url_and_its_user_goes_on(
    tmp_path, real_cgroups
):
    # The user asks once, waits for the test to kill the replica, then asks until it answers again.
    survive = (
        "import json, os, pathlib, time, urllib.request\n"
        "url = os.environ['EYRIE_SERVICE_WEB_URLS'] + '/'\n"
        "first = json.load(urllib.request.urlopen(url))['pid']\n"
        "pathlib.Path('asked').write_text(str(first))\n"
        "while True:\n"
        "    try:\n"
        "        second = json.load(urllib.request.urlopen(url, timeout=2))['pid']\n"
        "        if second != first:\n"
        "            break\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.2)\n"
        "print('answered by', first, 'then', second)\n"
    )
    user = {"name": "ask", "command": [sys.executable, "-c", survive], "memory": "64MiB", "uses": ["web"]}
    user["timeout"] = "120s"
    path = pipeline(tmp_path, [web(retries=1)], [user])
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    asked = run_dir / "ask" / "asked"
    deadline = time.monotonic() + 60
    while not asked.exists() and time.monotonic() < deadline and runner.poll() is None:
        time.sleep(0.1)
    assert asked.exists(), runner.communicate()[0]
    os.kill(int(asked.read_text()), signal.SIGKILL)
    out, _ = runner.communicate(timeout=120)
    assert runner.returncode == 0, out

    first, second = attempts(run_dir)["web[1]"]
    assert (first.verdict, first.signal) == ("crashed", signal.SIGKILL)
    assert second.verdict == "succeeded" and second.replica == first.replica == 1
    assert "starting it again (1 of 1 retries)" in out
    assert attempts(run_dir)["ask"][0].verdict == "succeeded"


class MovingLocalExecutor(LocalExecutor):
    """A fake placement over the real local executor: each start of a replica answers at another
    loopback address (127.0.0.N for its attempt N), as a Slurm job placed on another node would."""

    @staticmethod
    def service_host(handle) -> str:
        return f"127.0.0.{handle.launch.attempt}"


def test_a_replica_started_again_elsewhere_is_followed_by_its_running_user(tmp_path, real_cgroups):
    # The user asks where the step contract says the replica answers, waits for the test to kill
    # it, then asks again where it says now.
    follow = (
        "import json, pathlib, time, urllib.request\n"
        "from pipeline.contract.step import service_urls\n"
        "(first,) = service_urls('web')\n"
        "pathlib.Path('asked').write_text(str(json.load(urllib.request.urlopen(first + '/'))['pid']))\n"
        "while service_urls('web') == [first]:\n"
        "    time.sleep(0.2)\n"
        "(now,) = service_urls('web')\n"
        "print('moved', first, now, json.load(urllib.request.urlopen(now + '/', timeout=5))['pid'])\n"
    )
    user = {"name": "ask", "command": [sys.executable, "-c", follow], "memory": "64MiB", "uses": ["web"]}
    path = pipeline(tmp_path, [web(retries=1)], [{**user, "timeout": "120s"}])
    run_dir, out = tmp_path / "run", io.StringIO()
    reporter = ConsoleReporter(Console(file=out, width=200))
    orchestrator = Orchestrator(load_pipeline(path), path, run_dir, MovingLocalExecutor(), reporter)
    result: list = []
    runner = threading.Thread(target=lambda: result.append(orchestrator.run()))
    runner.start()
    asked = run_dir / "ask" / "asked"
    deadline = time.monotonic() + 60
    while not asked.exists() and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.1)
    assert asked.exists(), out.getvalue()
    os.kill(int(asked.read_text()), signal.SIGKILL)
    runner.join(120)
    assert result and result[0].state == "succeeded", out.getvalue()

    first, second = attempts(run_dir)["web[1]"]
    moved = re.search(r"moved (\S+) (\S+) (\d+)", out.getvalue())
    assert moved, out.getvalue()
    assert moved.group(1).startswith("http://127.0.0.1:") and moved.group(2).startswith("http://127.0.0.2:")
    assert int(moved.group(3)) == second.pid  # the new start answered, where it runs now
    assert service_urls_path(run_dir, "web").read_text() == moved.group(2) + "\n"


class SlowToSayReadyReporter(ConsoleReporter):
    """A test double: a console that takes a second to write the line saying a service is ready, as
    a terminal behind a slow link, or one held by other steps' output, would."""

    def note(self, text: str) -> None:
        if ": ready (" in text:
            time.sleep(1.0)
        super().note(text)


def test_a_user_starts_though_its_service_became_ready_while_the_runner_was_looking_elsewhere(
    tmp_path, real_cgroups
):
    # The service is ready, and says so slowly: the runner must not take "nothing is starting, nothing
    # runs" for the end of the run while the service's only user still waits for it.
    user = {"name": "ask", "command": [sys.executable, "-c", ASK_EACH], "memory": "64MiB", "uses": ["web"]}
    path = pipeline(tmp_path, [web()], [user])
    run_dir, out = tmp_path / "run", io.StringIO()
    reporter = SlowToSayReadyReporter(Console(file=out, width=200))
    result = Orchestrator(load_pipeline(path), path, run_dir, LocalExecutor(), reporter).run()
    assert result.state == "succeeded", out.getvalue()
    (ask,) = attempts(run_dir)["ask"]
    assert ask.verdict == "succeeded"
    assert "pids [" in out.getvalue()


def test_a_replica_not_ready_within_its_startup_timeout_is_timed_out(tmp_path, real_cgroups):
    command = [sys.executable, SERVER, "${EYRIE_SERVICE_PORT}", "60"]  # listens after a minute
    slow = web(command=command, startup_timeout="2s", retries=0)
    user = {"name": "ask", "command": ["true"], "memory": "16MiB", "uses": ["web"]}
    result = eyrie("run", str(pipeline(tmp_path, [slow], [user])), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    (replica,) = attempts(tmp_path / "run")["web[1]"]
    assert replica.verdict == "timed_out"
    assert "/health did not answer 200 within its startup_timeout (2.0s)" in replica.reason


USER = {"name": "ask", "command": ["true"], "memory": "16MiB", "uses": ["web"]}


@pytest.mark.parametrize(
    ("services", "steps", "says"),
    [
        ([], [USER], "steps[0] (ask).uses: unknown service 'web' (no service is declared)"),
        ([web(), web()], [USER], "service names must be unique; repeated: web"),
        ([web(name="ask")], [{**USER, "uses": ["ask"]}], "ask: the name of both a step and a service"),
        ([web(replicas=0)], [USER], "services[0] (web).replicas: Input should be greater than or equal to 1"),
        ([web(health="health")], [USER], "services[0] (web).health: String should match pattern"),
        ([{**web(), "replica": 2}], [USER], "(web).replica: unknown key; did you mean 'replicas'?"),
    ],
)
def test_a_bad_service_definition_is_one_line_naming_the_file_and_key(tmp_path, services, steps, says):
    path = pipeline(tmp_path, services, steps)
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    (line,) = str(caught.value).splitlines()
    assert line.startswith(f"{path}:") and says in line


def test_replicas_that_cannot_fit_beside_their_user_are_refused_before_anything_starts(
    tmp_path, real_cgroups
):
    path = pipeline(tmp_path, [web(replicas=64, memory="64TiB")], [USER])
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "services[0] (web): 64 replica(s) of 64.00 TiB beside its largest user need" in line
    assert not (tmp_path / "run").exists()  # nothing half-made


def test_replicas_asking_for_more_gpus_than_the_host_has_are_refused_before_anything_starts(
    tmp_path, real_cgroups
):
    # They run side by side on this host: 64 of 64 GPUs is more than any host has.
    path = pipeline(tmp_path, [web(replicas=64, gpus=64)], [USER])
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert re.search(
        r"services\[0\] \(web\)\.gpus: 64 replica\(s\) of 64 need 4096, more than the \d+ GPU\(s\) this host "
        r"has \(its PCI bus\); lower its gpus or replicas",
        line,
    ), line
    assert not (tmp_path / "run").exists()


def test_a_running_service_holds_its_memory_in_the_budget(tmp_path, real_cgroups):
    # 128 MiB of service and two 64 MiB steps do not fit in 200 MiB together: the two steps never
    # run at once while the service runs, whichever starts first.
    user = {"name": "ask", "command": [sys.executable, "-c", ASK_EACH], "memory": "64MiB", "uses": ["web"]}
    other = {"name": "other", "command": ["sleep", "3"], "memory": "64MiB"}
    path = pipeline(tmp_path, [web()], [user, other])
    spec = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**spec, "budget": "200MiB"}))
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = attempts(tmp_path / "run")
    (replica,), (ask,), (other_attempt,) = rows["web[1]"], rows["ask"], rows["other"]
    first, second = sorted([ask, other_attempt], key=lambda a: a.started_at)
    assert first.ended_at <= second.started_at
    assert replica.started_at < ask.started_at and replica.ended_at >= ask.ended_at


def test_a_local_replica_a_dead_runner_left_is_reaped_by_the_rerun_which_starts_its_own(
    tmp_path, real_cgroups
):
    user = {"name": "ask", "command": ["sleep", "600"], "memory": "16MiB", "uses": ["web"]}
    path = pipeline(tmp_path, [web()], [user])
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (run_dir.exists() and "ask" in attempts_or_none(run_dir)):
        time.sleep(0.2)
    (left,) = attempts(run_dir)["web[1]"]
    runner.kill()
    runner.wait()
    assert running(left.pid)  # the replica outlived its runner

    path.write_text(path.read_text().replace("sleep", "true").replace("'600'", "'0'"))
    result = eyrie("run", str(path), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = attempts(run_dir)["web[1]"]
    assert first.verdict == "cancelled" and "1 leftover process(es) killed" in first.reason  # as a step's
    assert second.verdict == "succeeded" and second.run_id != first.run_id
    assert not running(left.pid)


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no parent reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def attempts_or_none(run_dir: Path) -> dict[str, list]:
    try:
        return attempts(run_dir)
    except (FileNotFoundError, sqlite3.Error):  # not written yet
        return {}


def test_a_service_given_a_url_is_an_external_server_nothing_starts_and_its_users_get_it(tmp_path):
    # What the step is given, and what the step contract reads: the external URL, whatever an
    # earlier run that started the service itself left in the run directory.
    write_urls = (
        "import os; from pipeline.contract.step import service_urls\n"
        "given, read = os.environ['EYRIE_SERVICE_WEB_URLS'], ','.join(service_urls('web'))\n"
        "open('urls.txt', 'w').write(given + '\\n' + read)\n"
    )
    user = {"name": "ask", "command": [sys.executable, "-c", write_urls], "memory": "64MiB", "uses": ["web"]}
    external = web(url="${TEST_SERVER_URL:-}", command=["false"])
    path = pipeline(tmp_path, [external], [user])
    atomic_write_text(service_urls_path(tmp_path / "run", "web"), "http://127.0.0.1:9\n")
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "TEST_SERVER_URL": "http://elsewhere:8000/"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        tmp_path / "run" / "ask" / "urls.txt"
    ).read_text() == "http://elsewhere:8000\nhttp://elsewhere:8000"
    assert set(attempts(tmp_path / "run")) == {"ask"}  # no replica was started
    assert "web: the external server at http://elsewhere:8000; nothing started" in result.stdout


def test_an_external_url_without_a_scheme_is_one_line(tmp_path):
    path = pipeline(tmp_path, [web(url="elsewhere:8000")], [USER])
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    (line,) = str(caught.value).splitlines()
    assert "services[0] (web).url: 'elsewhere:8000' is not a server URL; write it with its scheme" in line


def test_a_replicas_recorded_command_gives_its_port_only_while_the_file_says_the_same(tmp_path):
    from pipeline.run.services import recorded_port

    path = pipeline(tmp_path, [web(command=["srv", "--port=${EYRIE_SERVICE_PORT}", "--x", "1"])], [USER])
    service = load_pipeline(path).service("web")
    assert recorded_port(path, tmp_path, service, ["srv", "--port=41234", "--x", "1"]) == 41234
    assert recorded_port(path, tmp_path, service, ["srv", "--port=41234", "--x", "2"]) is None  # changed
    assert recorded_port(path, tmp_path, service, ["srv", "--port=41234"]) is None
