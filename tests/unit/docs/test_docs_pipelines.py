"""Every pipeline example of the documentation pages (a yaml block with `steps:`) passes `eyrie run
--check`, unless its first line marks it `# fragment`: the check says ok, or refuses only what this
machine lacks (the examples are written for a GPU host: their memory and GPUs)."""

from __future__ import annotations

import re

import pytest
import yaml

from eyrie_testing import docs_text, eyrie

BLOCKS = re.findall(r"^```yaml\n(.*?)^```", docs_text(), re.M | re.S)
PIPELINES = [b for b in BLOCKS if re.search(r"^steps:", b, re.M) and not b.startswith("# fragment")]


def test_the_docs_have_pipeline_examples():
    assert PIPELINES


@pytest.mark.parametrize("example", PIPELINES, ids=lambda b: b.splitlines()[0][:40])
def test_a_docs_pipeline_passes_the_check(tmp_path, example):
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(example)
    for step in yaml.safe_load(example)["steps"]:  # the files it names beside it
        for name in step.get("inputs", []):
            (tmp_path / name).write_text("")
    result = eyrie("run", "--check", str(pipeline), "--run-dir", str(tmp_path / "run"))
    wrong = [line for line in result.stderr.splitlines() if not re.search(r"this host (really )?has", line)]
    assert not wrong, result.stderr
    assert "ok" in result.stdout or result.returncode == 2, result.stdout + result.stderr
    assert not (tmp_path / "run").exists()  # a check writes nothing
