"""A step's fingerprint, and whether a rerun may skip it.

The fingerprint covers what makes a step's outputs what they are: its expanded command, its
``env`` and declared outputs, the manifests of the steps it needs, its input files' contents, and
the executor options that change results (e.g. a Docker image). The runner gives it to each
attempt (``FINGERPRINT_ENV``) and the manifest records it: a step whose manifest holds the same
fingerprint and still matches its outputs is up to date.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.run import EXECUTORS
from pipeline.run.spec import PipelineSpec, StepSpec
from pipeline.run.step_contract import check_manifest, manifest_digest, read_manifest, sha256_file
from pipeline.run.step_inputs import missing_input


def step_fingerprint(
    spec: PipelineSpec, pipeline_path: Path, run_dir: Path, step: StepSpec, argv: list[str]
) -> str:
    inputs = {}
    for rel in step.inputs:
        path = pipeline_path.parent / rel
        if not path.is_file():
            raise missing_input(pipeline_path, step, path)
        inputs[rel] = sha256_file(path)
    payload = {
        "argv": argv,
        "env": step.env,
        "outputs": step.outputs,
        "needs": {n: manifest_digest(run_dir / n) for n in step.needs},
        "inputs": inputs,
    }
    for executor in EXECUTORS:  # e.g. a step's Docker image: other options leave results as they are
        payload.update(spec.executor_options(executor, step.name).fingerprint())
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def check_up_to_date(run_dir: Path, step: StepSpec, fingerprint: str) -> tuple[bool, str]:
    """Whether the step's manifest holds ``fingerprint`` and matches its outputs, and why (not)."""
    step_dir = run_dir / step.name
    manifest = read_manifest(step_dir)
    if manifest is None:
        return False, "no manifest"
    if manifest.fingerprint != fingerprint:
        return False, "its command, inputs or upstream outputs changed"
    complete, detail = check_manifest(step_dir, step.outputs)
    if not complete:
        return False, detail
    return True, "up to date: its manifest matches its outputs and inputs"
