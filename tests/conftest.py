"""Shared fixtures: whether real cgroups can be used here."""

from __future__ import annotations

import pytest


def _cgroups_writable() -> str | None:
    """None when this process can create memory-limited child cgroups, else why not."""
    try:
        from pipeline.memory import CgroupError, step_parent

        parent = step_parent()
        probe = parent.child("eyrie-probe")
        probe.create()
        probe.set_limit(64 * 1024 * 1024)
        probe.remove()
    except (CgroupError, OSError) as exc:
        return f"cannot create memory-limited cgroups here: {exc}"
    return None


@pytest.fixture(scope="session")
def real_cgroups() -> None:
    reason = _cgroups_writable()
    if reason:
        pytest.skip(reason)
