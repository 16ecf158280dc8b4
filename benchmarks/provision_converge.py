"""How long the CI converge of the provisioning roles takes, phase by phase.

Starts the same test host as tests/integration/test_provision_converge.py (a
Debian 12 container with systemd and sshd, stand-in packages from local signed
repositories), then times the runs that test makes: first converge, the
docker role alone (tags), a second converge (must change nothing), check mode
with drift planted (must report it alone), the plain run that repairs it, the
inventory check every run starts with, and the testinfra suite (`eyrie verify`).

    .venv/bin/python -m benchmarks.provision_converge
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "provision"))

from ci_host import ci_host, docker, docker_engine_missing  # noqa: E402

from pipeline.provision import provision  # noqa: E402
from pipeline.provision.inventory import read_inventory  # noqa: E402
from pipeline.provision.runner import ANSIBLE_DIR, HOST_GROUP  # noqa: E402

DRIFT = ("/etc/modprobe.d/eyrie-blacklist-nouveau.conf", "/etc/profile.d/eyrie-cuda.sh")


def main() -> int:
    reason = docker_engine_missing()
    if reason:
        print(f"provision_converge: {reason}", file=sys.stderr)
        return 1
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-provision-") as tmp, ci_host(Path(tmp)) as host:
        for phase, seconds in host.timings.items():
            rows.append((phase, seconds, "cached on reruns" if phase != "host start" else ""))
        started = time.monotonic()
        inventory = host.inventory
        read_inventory([inventory], user_source=inventory, group=HOST_GROUP, ansible_dir=ANSIBLE_DIR)
        rows.append(("inventory check (ansible-inventory)", time.monotonic() - started, "before every run"))
        runs = (
            ("first converge", {}),
            ("tags=docker", {"tags": ["docker"]}),
            ("second converge", {}),
            ("check mode, drift planted", {"check": True}),
            ("plain run, repairs the drift", {}),
        )
        for phase, options in runs:
            if phase.startswith("check"):
                docker("exec", host.container, "rm", *DRIFT)
            started = time.monotonic()
            result = provision(inventory=host.inventory, data_dir=host.data_dir, **options)
            elapsed = time.monotonic() - started
            if not result.succeeded:
                print(f"{phase} failed: {[f.line() for f in result.failures]}", file=sys.stderr)
                return 1
            rows.append((phase, elapsed, f"{result.changed()} changed"))
        started = time.monotonic()
        verify = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "verify", "--inventory", str(host.inventory)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        summary = verify.stdout.strip().splitlines()[-1] if verify.stdout.strip() else verify.stderr[-200:]
        rows.append(("eyrie verify (testinfra)", time.monotonic() - started, summary.strip("= ")))
    print("| phase | seconds | result |\n|---|---|---|")
    for phase, seconds, note in rows:
        print(f"| {phase} | {seconds:.1f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
