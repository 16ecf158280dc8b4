"""Byte sizes and durations as people write them: ``512MiB``, ``4GiB``, ``30s``, ``2h``."""

from __future__ import annotations

import re

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|min|s|m|h|d)")


def parse_size(text: str | int) -> int:
    """Bytes from ``"4GiB"``, ``"512MiB"``, ``"1.5G"`` or a plain integer."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r} (write e.g. 512MiB, 4GiB, 2GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_size(num_bytes: int | None, unit: str | None = None) -> str:
    """``1.50 GiB``, in the largest unit below the value or in ``unit`` (``GiB``: figures meant to
    be compared with each other); ``-`` for unknown."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for name in _BINARY_UNITS:
        if (abs(value) < 1024 if unit is None else name == unit) or name == _BINARY_UNITS[-1]:
            return f"{value:.0f} {name}" if name == "B" else f"{value:.2f} {name}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_duration(text: str | int | float) -> float:
    """Seconds from ``"30s"``, ``"2h"``, ``"1h30m"``, ``"500ms"`` or a number of seconds."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"duration must be positive: {text}")
        return float(text)
    compact = str(text).replace(" ", "").lower()
    parts = _DURATION_RE.findall(compact)
    if not parts or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"invalid duration {text!r} (write e.g. 30s, 10m, 2h, 1h30m)")
    seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"duration must be positive: {text!r} (write e.g. 30s, 10m, 2h, 1h30m)")
    return seconds


def duration_text(seconds: float) -> str:
    """``seconds`` as an option is written (``10m``, ``1h30m``, ``45s``): what parse_duration reads."""
    whole = int(round(seconds))
    if whole != seconds or whole < 1:
        return f"{seconds:g}s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
