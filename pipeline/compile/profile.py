"""Measured compile-job peaks, and the predictions the scheduler admits jobs by.

A compile job is keyed by what decides its memory: the source file, the set of
GPU architectures one nvcc process compiles, ``--threads`` and the nvcc
version. Profiles are JSON files of measured entries (peak anonymous memory,
wall time, a coarse memory-over-time shape); the ones measured for flash-attn
ship in ``pipeline/compile/profiles/``.

Prediction order for a job:
1. an entry with exactly its key;
2. an entry for the same file measured with another arch set or thread count,
   scaled by the number of architectures nvcc compiles at once
   (``min(threads, archs)``: ``--threads`` parallelises over gencode targets);
3. for a file never measured, the largest figure measured so far in this build
   for a job of the same configuration (the "correction from finished jobs"),
   or, before any job has finished, the conservative default.
Every prediction is then multiplied by a safety margin.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

SHIPPED_PROFILES = Path(__file__).parent / "profiles"
SAFETY_MARGIN = 1.15
"""Peaks of one file vary by a few per cent between runs; 15% covers that and a
different host compiler's front end."""


@dataclass(frozen=True)
class JobKey:
    source: str
    """The translation unit's file name (no directory: the same file in another checkout)."""
    archs: tuple[str, ...]
    threads: int
    nvcc: str
    """nvcc's ``major.minor`` release."""

    @property
    def archs_in_flight(self) -> int:
        return max(1, min(self.threads, len(self.archs)))

    def config(self) -> tuple[tuple[str, ...], int, str]:
        return self.archs, self.threads, self.nvcc


@dataclass
class ProfileEntry:
    source: str
    archs: list[str]
    threads: int
    nvcc: str
    anon_peak_bytes: int
    wall_s: float
    peak_bytes: int | None = None
    shape: list[float] = field(default_factory=list)
    """Anonymous memory at 20 evenly spaced moments of the job, as fractions of its peak."""
    samples: int = 1

    @property
    def key(self) -> JobKey:
        return JobKey(self.source, tuple(self.archs), self.threads, self.nvcc)


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    wall_s: float | None
    basis: str
    """Where the figure comes from, in words (for the ledger's limit reason and the log)."""


_GENCODE = re.compile(r"(?:arch=compute_|code=sm_|code=compute_|sm_)(\d+[af]?)")


def parse_nvcc_argv(argv: list[str]) -> tuple[str | None, tuple[str, ...], int]:
    """The source file, the arch set and ``--threads`` of an nvcc command line."""
    source, archs, threads = None, set(), 1
    args = iter(range(len(argv)))
    for i in args:
        arg = argv[i]
        if arg == "-c" and i + 1 < len(argv):
            source = argv[i + 1]
        elif arg in ("-gencode", "--generate-code") and i + 1 < len(argv):
            archs.update(_GENCODE.findall(argv[i + 1].split(",")[0]))
        elif arg.startswith(("-gencode=", "--generate-code=")):
            archs.update(_GENCODE.findall(arg.split("=", 1)[1].split(",")[0]))
        elif arg in ("--threads", "-t") and i + 1 < len(argv):
            threads = int(argv[i + 1])
        elif arg.startswith("--threads="):
            threads = int(arg.split("=", 1)[1])
        elif arg.startswith(("-arch=sm_", "--gpu-architecture=sm_")):
            archs.update(_GENCODE.findall(arg))
    if threads == 0:  # nvcc: 0 means one thread per CPU
        threads = os.cpu_count() or 1
    return source, tuple(sorted(archs, key=_arch_order)), threads


def _arch_order(arch: str) -> tuple[int, str]:
    digits = re.match(r"\d+", arch)
    return (int(digits.group()) if digits else 0, arch)


def shape_of(timeline: list[tuple[float, int, int]], points: int = 20) -> list[float]:
    """A timeline of (t, total, anon) reduced to ``points`` fractions of its anonymous peak."""
    if not timeline:
        return []
    peak = max(anon for _, _, anon in timeline) or 1
    end = timeline[-1][0] or 1.0
    buckets: list[list[int]] = [[] for _ in range(points)]
    for t, _, anon in timeline:
        buckets[min(points - 1, max(0, math.ceil(t / end * points) - 1))].append(anon)
    out: list[float] = []
    for bucket in buckets:
        out.append(round(max(bucket) / peak, 3) if bucket else (out[-1] if out else 0.0))
    return out


class ProfileError(ValueError):
    """A profile file cannot be read; the message names the file and what is wrong with it."""


class Profile:
    """Measured entries plus what this build has learned so far.

    The broker's handler threads observe and predict at once: every change, and
    every copy taken to iterate over, holds the lock.
    """

    def __init__(self, entries: list[ProfileEntry] | None = None, *, default_peak: int,
                 margin: float = SAFETY_MARGIN) -> None:  # fmt: skip
        self.default_peak = default_peak
        self.margin = margin
        self._entries: dict[JobKey, ProfileEntry] = {}
        self._learned_max: dict[tuple, int] = {}
        self._lock = threading.RLock()  # re-entrant: observe adds while holding it
        for entry in entries or []:
            self.add(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[ProfileEntry]:
        with self._lock:
            return list(self._entries.values())

    def add(self, entry: ProfileEntry) -> None:
        """Record a measurement; a repeated key keeps the larger peak (conservative)."""
        with self._lock:
            old = self._entries.get(entry.key)
            if old is not None and old.anon_peak_bytes >= entry.anon_peak_bytes:
                old.samples += 1
                return
            if old is not None:
                entry.samples = old.samples + 1
            self._entries[entry.key] = entry

    def observe(self, key: JobKey, anon_peak: int, wall_s: float,
                timeline: list[tuple[float, int, int]] | None = None) -> None:  # fmt: skip
        """A finished job's real figures: they correct predictions for the rest of the build."""
        config = key.config()
        entry = ProfileEntry(key.source, list(key.archs), key.threads, key.nvcc, anon_peak,
                             round(wall_s, 2), shape=shape_of(timeline or []))  # fmt: skip
        with self._lock:
            self._learned_max[config] = max(self._learned_max.get(config, 0), anon_peak)
            self.add(entry)

    def predict(self, key: JobKey) -> Prediction:
        exact = self._entries.get(key)
        if exact is not None:
            return Prediction(
                math.ceil(exact.anon_peak_bytes * self.margin), exact.wall_s,
                f"measured {_gib(exact.anon_peak_bytes)} × {self.margin} margin",
            )  # fmt: skip
        same_file = [e for e in self.entries() if e.source == key.source and e.nvcc == key.nvcc]
        if same_file:
            base = max(same_file, key=lambda e: e.anon_peak_bytes)
            factor = key.archs_in_flight / base.key.archs_in_flight
            waves = math.ceil(len(key.archs) / key.archs_in_flight)
            base_waves = math.ceil(len(base.archs) / base.key.archs_in_flight)
            return Prediction(
                math.ceil(base.anon_peak_bytes * factor * self.margin),
                base.wall_s * waves / base_waves,
                f"measured {_gib(base.anon_peak_bytes)} for sm {';'.join(base.archs)} threads "
                f"{base.threads}, × {factor:g} archs in flight × {self.margin} margin",
            )  # fmt: skip
        learned = self._learned_max.get(key.config())
        if learned is not None:
            return Prediction(
                math.ceil(learned * self.margin), None,
                f"unmeasured file: largest peak finished so far {_gib(learned)} × {self.margin}",
            )  # fmt: skip
        return Prediction(self.default_peak, None, f"unmeasured file: default {_gib(self.default_peak)}")

    # -- files --------------------------------------------------------------------------
    @classmethod
    def load(cls, paths: list[Path], *, default_peak: int, margin: float = SAFETY_MARGIN) -> Profile:
        entries: list[ProfileEntry] = []
        for path in paths:
            files = sorted(path.glob("*.json")) if path.is_dir() else [path]
            for file in files:
                try:
                    data = json.loads(file.read_text(encoding="utf-8"))
                    entries.extend(ProfileEntry(**raw) for raw in data["entries"])
                except OSError as exc:
                    raise ProfileError(f"cannot read profile {file} ({exc.strerror or exc})") from exc
                except (ValueError, KeyError, TypeError) as exc:
                    what = "no 'entries' list" if isinstance(exc, KeyError) else exc
                    raise ProfileError(f"profile {file} is not a measured profile ({what})") from exc
        return cls(entries, default_peak=default_peak, margin=margin)

    def save(self, path: Path, *, note: str, only_nvcc: str | None = None) -> None:
        from pipeline.run.manifest import atomic_write_text

        entries = [asdict(e) for e in self.entries() if only_nvcc in (None, e.nvcc)]
        entries.sort(key=lambda e: (e["nvcc"], e["archs"], e["threads"], e["source"]))
        lines = ",\n".join("  " + json.dumps(e) for e in entries)  # one measured job a line
        atomic_write_text(path, f'{{\n "note": {json.dumps(note)},\n "entries": [\n{lines}\n ]\n}}\n')


def _gib(num: int) -> str:
    return f"{num / 2**30:.2f} GiB"
