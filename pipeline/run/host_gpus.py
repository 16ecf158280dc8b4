"""The GPUs of this host, as its PCI bus lists them: NVIDIA display and 3D controllers.

Read from sysfs, which a container sees as its host's, so the count is the same for a runner in
the compose ``pipeline`` service as on the host, with or without a driver (an NVSwitch is a
bridge, not counted).
"""

from __future__ import annotations

from pathlib import Path

NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASS = "0x03"
"""PCI base class 03: display controllers (VGA 0x0300, 3D 0x0302)."""


def host_gpus(sysfs: Path = Path("/sys")) -> int:
    """How many NVIDIA GPUs this host has (0 without a PCI bus to read)."""
    count = 0
    for device in (sysfs / "bus" / "pci" / "devices").glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            klass = (device / "class").read_text().strip()
        except OSError:
            continue
        count += vendor == NVIDIA_VENDOR and klass.startswith(DISPLAY_CLASS)
    return count
