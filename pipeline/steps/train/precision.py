"""The precision training computes in: bf16 on a GPU that multiplies bf16 fast, else fp32.

In bf16 the frozen target is held in bf16 and its forward and the draft's run under bf16 autocast;
the draft's master weights, the optimizer's states, the loss and the teacher's softmax stay fp32.
On a CPU ``auto`` stays fp32: on the tiny target, bf16's draft decoded 8.5% fewer tokens per
target forward than fp32's after the same steps (benchmarks/README.md, "Training"), more than the
3% bf16 may cost. ``--precision bf16`` still asks for it, and a CPU without bf16 instructions
is told it emulates them.
Light on purpose (torch is imported where it is used): the command line reads ``Precision`` here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

Precision = Literal["auto", "fp32", "bf16"]

# The ISA extensions with bf16 matrix instructions, as /proc/cpuinfo names them: without one,
# oneDNN emulates bf16 through fp32, which is slower than fp32 itself.
_X86_BF16 = frozenset({"avx512_bf16", "amx_bf16"})
_ARM_BF16 = "bf16"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's ISA flags (x86 ``flags``, Arm ``Features``) of its first core; none where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_bf16_is_fast(capability: str, flags: frozenset[str]) -> bool:
    """Whether a CPU whose torch kernels are ``capability`` (``torch.backends.cpu.get_cpu_capability()``)
    and whose ISA ``flags`` are these multiplies bf16 faster than fp32."""
    if capability.startswith("AVX"):  # x86: torch's bf16 kernels are AVX-512 ones
        return capability == "AVX512" and bool(_X86_BF16 & flags)
    return _ARM_BF16 in flags


@functools.cache
def fast_bf16(device_type: str) -> bool:
    """Whether ``device_type`` (``cuda`` or ``cpu``) has bf16 arithmetic faster than fp32."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_is_fast(torch.backends.cpu.get_cpu_capability(), cpu_flags())


def training_device_type() -> str:
    """The device type this process trains on: a GPU where one is visible, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(choice: Precision, device_type: str | None = None) -> Literal["fp32", "bf16"]:
    """``auto`` made concrete for ``device_type`` (default: the training device's)."""
    if choice != "auto":
        return choice
    device_type = device_type or training_device_type()
    return "bf16" if device_type == "cuda" and fast_bf16(device_type) else "fp32"


def emulated_note(precision: str, device_type: str) -> str | None:
    """A note for bf16 on a device without bf16 arithmetic of its own (None otherwise)."""
    if precision != "bf16" or fast_bf16(device_type):
        return None
    if device_type == "cuda":
        return "note: --precision bf16 on a GPU without bf16 arithmetic: emulated, slower than fp32"
    import torch

    return (
        f"note: --precision bf16 on a CPU without bf16 instructions (torch's kernels: "
        f"{torch.backends.cpu.get_cpu_capability()}): emulated, several times slower than fp32 here"
    )


def dtype_of(precision: Literal["fp32", "bf16"]):
    """The dtype the target is held in (and its features written in) at this precision."""
    import torch

    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(precision: Literal["fp32", "bf16"], device_type: str):
    """bf16 autocast on ``device_type`` at bf16; a context that changes nothing at fp32."""
    import torch

    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")
