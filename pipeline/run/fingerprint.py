"""A step's fingerprint, and whether a rerun may skip it.

The fingerprint covers what makes a step's outputs what they are: its expanded command, its
``env`` and declared outputs, the manifests of the steps it needs, its input files' contents, the
files its command names outside the run directory (a catalog, a prompts file), and the executor
options that change results (e.g. a Docker image). The runner gives it to each
attempt (``FINGERPRINT_ENV``) and the manifest records it: a step whose manifest holds the same
fingerprint and still matches its outputs is up to date.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.contract.step import MANIFEST_NAME, check_manifest, manifest_digest, read_manifest, sha256_file
from pipeline.memory import MIB
from pipeline.run import EXECUTORS
from pipeline.run.ledger import AttemptRow
from pipeline.run.spec import PipelineSpec, StepSpec
from pipeline.run.step_inputs import missing_input
from pipeline.run.verdict import DONE_VERDICTS


def step_fingerprint(
    spec: PipelineSpec, pipeline_path: Path, run_dir: Path, step: StepSpec, argv: list[str]
) -> str:
    return digest(fingerprint_parts(spec, pipeline_path, run_dir, step, argv))


def digest(parts: dict[str, Any]) -> str:
    """The fingerprint of ``parts`` (:func:`fingerprint_parts`)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def fingerprint_parts(
    spec: PipelineSpec, pipeline_path: Path, run_dir: Path, step: StepSpec, argv: list[str]
) -> dict[str, Any]:
    """What the fingerprint is made of, by name: the ledger keeps them with each attempt, so that a
    rerun can say which of them changed."""
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
    named = named_files(
        run_dir, step, argv, declared={(pipeline_path.parent / rel).resolve() for rel in inputs}
    )
    if named:  # only then: a step whose command names no file keeps the fingerprint it had
        payload["files"] = named
    for executor in EXECUTORS:  # e.g. a step's Docker image: other options leave results as they are
        payload.update(spec.executor_options(executor, step.name).fingerprint())
    return payload


HASHED_FILE_LIMIT = 64 * MIB
"""A named file up to this size is known by its content; a larger one (a model's weights) by its
size and modification time, as make knows files, so that deciding costs no read of it."""


def named_files(run_dir: Path, step: StepSpec, argv: list[str], declared: set[Path]) -> dict[str, str]:
    """The files the command names (an argument, or an option's ``--name=value``) outside the run
    directory, by content: a catalog edited in place reruns prep, as an edited input does. A
    relative name is the step's, which runs in its own directory; files in the run directory are
    upstream outputs, which the needed steps' manifests already cover, and ``declared`` inputs
    are the fingerprint's already."""
    step_dir, inside = run_dir / step.name, run_dir.resolve()
    named = {}
    for argument in argv[1:]:
        value = argument.split("=", 1)[1] if argument.startswith("--") and "=" in argument else argument
        try:
            path = (step_dir / value).resolve()
            if not value or not path.is_file() or path.is_relative_to(inside) or path in declared:
                continue
            stat = path.stat()
        except OSError:  # not a name a file could have, e.g. too long
            continue
        named[value] = (
            sha256_file(path)
            if stat.st_size <= HASHED_FILE_LIMIT
            else f"{stat.st_size} bytes, modified {stat.st_mtime_ns}"
        )
    return named


def check_up_to_date(
    run_dir: Path, step: StepSpec, parts: dict[str, Any], earlier: list[AttemptRow]
) -> tuple[bool, str]:
    """Whether the step's manifest holds the fingerprint of ``parts`` and matches its outputs, and
    why (not), in words: what changed since the attempt that wrote the manifest (among ``earlier``,
    the step's attempts in the ledger), or how its last attempt ended."""
    step_dir = run_dir / step.name
    manifest = read_manifest(step_dir)
    if manifest is None:
        if not earlier:
            return False, "it has not run in this run directory"
        last = earlier[-1]
        if last.verdict and last.verdict not in DONE_VERDICTS:
            return False, f"its last attempt ({last.attempt}) ended {last.verdict}"
        return False, f"its {MANIFEST_NAME} is gone"
    if manifest.fingerprint != digest(parts):
        made = [
            r for r in earlier if r.fingerprint_parts and digest(r.fingerprint_parts) == manifest.fingerprint
        ]
        if not made:  # written before the ledger kept the parts
            return False, "its command, inputs or upstream outputs changed"
        return False, "; ".join(_changes(made[-1].fingerprint_parts, parts))
    complete, detail = check_manifest(step_dir, step.outputs)
    if not complete:
        return False, f"an output changed: {detail}"
    return True, "up to date: its manifest matches its outputs and inputs"


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two attempts' fingerprint parts, each said as what a user changed."""
    said = []
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key), new.get(key)
        if was == now:
            continue
        if key == "argv":
            first = next(
                (i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b), min(len(was), len(now))
            )
            said.append(
                f"its command changed at argument {first}: {_word(was, first)} -> {_word(now, first)}"
            )
        elif key in ("needs", "inputs", "files", "env"):
            what = {"needs": "the outputs of step", "inputs": "input", "files": "file", "env": "env"}[key]
            names = sorted(
                n for n in set(was or {}) | set(now or {}) if (was or {}).get(n) != (now or {}).get(n)
            )
            said += [f"{what} {name} changed" for name in names]
        else:
            said.append(f"its {key} changed")
    return said


def _word(argv: list[str], i: int) -> str:
    return repr(argv[i]) if i < len(argv) else "(none)"
