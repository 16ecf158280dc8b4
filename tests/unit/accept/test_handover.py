"""The GPUs change hands between the target server and a step (``sglang.gpus_released``): exactly one
release and one resume, whatever stops the step, against a test fake of SGLang's server that dies, as
torch_memory_saver makes SGLang die, on a second release or a resume of memory it holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from fakes.fake_sglang import FakeSGLang

from pipeline.steps.generate.client import Retry
from pipeline.steps.serving.sglang import SGLangRefused, SGLangUnavailable, gpus_released, release_record

NO_WAIT = Retry(base_s=0.0, cap_s=0.0)
RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"


@pytest.fixture
def server():
    fake = FakeSGLang()
    yield fake
    fake.close()


def _released(url, tmp_path, said: list[str] | None = None):
    return gpus_released(url, tmp_path, retry=NO_WAIT, say=(said if said is not None else []).append)


def test_the_served_target_gives_its_gpus_for_the_step_and_takes_them_back(server, tmp_path):
    record = release_record(server.url, tmp_path)
    with _released(server.url, tmp_path):
        assert server.calls == ["/server_info", RELEASE] and server.released
        assert json.loads(record.read_text())["url"] == server.url  # the run knows it is released
    assert server.calls[-1] == RESUME and not server.released and not record.exists()
    with gpus_released(None, tmp_path):
        pass
    assert len(server.calls) == 3 and server.died is None


def test_a_server_without_the_memory_saver_is_refused_before_the_step_runs(tmp_path):
    server = FakeSGLang(memory_saver=False)  # SGLang would answer the release and free nothing
    try:
        with pytest.raises(SGLangRefused) as info, _released(server.url, tmp_path):
            pytest.fail("the step must not run on GPUs the server still holds")
    finally:
        server.close()
    message = str(info.value)
    assert "--enable-memory-saver" in message and "\n" not in message
    assert RELEASE not in server.calls


def test_a_server_that_is_not_there_is_no_settings_problem(tmp_path):
    server = FakeSGLang()
    url = server.url
    server.close()  # nothing listens on its port any more
    with pytest.raises(SGLangUnavailable) as info, _released(url, tmp_path):
        pytest.fail("nothing was released")
    assert "--enable-memory-saver" not in str(info.value)
    assert not release_record(url, tmp_path).exists()


def test_sigterm_in_the_step_still_gives_the_gpus_back(server, tmp_path):
    """The runner's timeout or cancel is a SIGTERM: the block is left through an exception, and the
    memory is taken back before the step exits 128 + 15."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from pipeline.steps.serving.sglang import Terminated, gpus_released
        try:
            with gpus_released({server.url!r}, __import__("pathlib").Path({str(tmp_path)!r})):
                print("released", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        except Terminated as exc:
            sys.exit(128 + exc.signum)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert server.calls == ["/server_info", RELEASE, RESUME] and not server.released
    assert not release_record(server.url, tmp_path).exists()


@pytest.mark.parametrize("failure", [503, 0], ids=["not-now", "no-answer"])
def test_a_failed_resume_is_said_and_the_next_step_takes_the_memory_back_without_releasing_again(
    tmp_path, failure
):
    server = FakeSGLang(failures={RESUME: [failure] * 10})
    said: list[str] = []
    try:
        with _released(server.url, tmp_path, said):
            pass  # the step's work succeeded: the failed resume must not undo that
        assert server.released and said and said[0].startswith("warning: the target server")
        record = release_record(server.url, tmp_path)
        assert record.exists() and str(record) in said[0]
        # "not now" is asked again; a request whose answer was lost may have been done: never resent
        assert server.calls.count(RESUME) == (1 + NO_WAIT.max_retries if failure else 1)
        server.failures.clear()
        said.clear()
        with _released(server.url, tmp_path, said):
            assert server.calls.count(RELEASE) == 1  # not released again: SGLang would die of it
        assert "is still released by step" in said[0]
        assert not server.released and server.died is None and not record.exists()
    finally:
        server.close()


def test_a_record_of_an_earlier_start_of_the_server_is_set_aside(server, tmp_path):
    """A server restarted since (another random seed) holds its memory: it is released as usual."""
    record = release_record(server.url, tmp_path)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"url": server.url, "server": 999, "by": "step train (pid 1)"}))
    said: list[str] = []
    with _released(server.url, tmp_path, said):
        assert server.released
    assert "describes an earlier start" in said[0]
    assert server.calls.count(RELEASE) == server.calls.count(RESUME) == 1 and server.died is None


def test_a_server_without_a_copy_of_its_weights_is_left_released(tmp_path):
    """torch_memory_saver throws released weights away unless the server keeps a CPU copy: a resumed
    server would compute with garbage."""
    server = FakeSGLang(weights_backup=False)
    said: list[str] = []
    try:
        with _released(server.url, tmp_path, said):
            pass
        assert RESUME not in server.calls and server.released
        assert "stays released" in said[0] and "--enable-weights-cpu-backup" in said[0]
        with _released(server.url, tmp_path, said):  # the next step of the run: nothing to release
            pass
        assert server.calls.count(RELEASE) == 1 and server.died is None
    finally:
        server.close()


def test_the_record_lives_in_the_run_directory(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_RUN_DIR", str(tmp_path / "run"))
    record = release_record(server.url, tmp_path / "run" / "train")
    assert record.parent == tmp_path / "run" / ".eyrie"
    assert release_record(server.url, tmp_path / "run" / "accept") == record  # the steps of a run share it
    assert os.path.basename(record) != os.path.basename(release_record(server.url + "1", tmp_path))
