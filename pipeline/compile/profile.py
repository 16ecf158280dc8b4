"""Measured compile-job peaks, and the predictions the scheduler admits jobs by.

A compile job is keyed by what decides its memory: the package being built and
its version (``flash-attn 2.8.3``), the source file, the set of GPU
architectures one nvcc process compiles, ``--threads`` and the nvcc release.
Profiles are JSON files of measured entries (peak anonymous memory, wall time,
a coarse memory-over-time shape); the ones measured for flash-attn ship in
``pipeline/compile/profiles/``.

Prediction order for a job:
1. an entry with exactly its key;
2. an entry for the same file of the same package version, from the nearest
   toolchain measured (its own nvcc first, else the nearest nvcc release), with
   the arch set and thread count closest to the job's, scaled by the number of
   architectures nvcc compiles at once (``min(threads, archs)``: ``--threads``
   parallelises over gencode targets), and by what this build's finished jobs of
   the same configuration showed against their own such estimates (their
   largest ratio, never below 1: a derived figure is never lowered);
3. for a file never measured in any toolchain, the conservative default, raised
   to the largest peak this build has seen in the configuration if that is more.
Every measured or derived figure is then multiplied by a safety margin.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.memory.units import format_size

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
    package: str
    """What the file belongs to, with its version (``flash-attn 2.8.3``): another version is another file."""

    @property
    def archs_in_flight(self) -> int:
        return max(1, min(self.threads, len(self.archs)))

    @property
    def waves(self) -> int:
        """How many times nvcc compiles ``archs_in_flight`` archs one after the other."""
        return math.ceil(len(self.archs) / self.archs_in_flight) if self.archs else 1

    def config(self) -> tuple[str, tuple[str, ...], int, str]:
        return self.package, self.archs, self.threads, self.nvcc


@dataclass
class ProfileEntry:
    source: str
    archs: list[str]
    threads: int
    nvcc: str
    anon_peak_bytes: int
    wall_s: float
    package: str
    peak_bytes: int | None = None
    shape: list[float] = field(default_factory=list)
    """Anonymous memory at 20 evenly spaced moments of the job, as fractions of its peak."""
    samples: int = 1

    @classmethod
    def measured(cls, key: JobKey, anon_peak_bytes: int, wall_s: float, shape: list[float]) -> ProfileEntry:
        """The entry of one measurement of the job ``key``: the inverse of ``key``."""
        return cls(
            source=key.source,
            archs=list(key.archs),
            threads=key.threads,
            nvcc=key.nvcc,
            anon_peak_bytes=anon_peak_bytes,
            wall_s=wall_s,
            package=key.package,
            shape=shape,
        )

    @property
    def key(self) -> JobKey:
        return JobKey(self.source, tuple(self.archs), self.threads, self.nvcc, self.package)


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    """What the job reserves: the expected peak × the margin, or the default."""
    wall_s: float | None
    basis: str
    """Where the figure comes from, in words (for the ledger's limit reason and the log)."""
    expected_bytes: int | None = None
    """The peak expected from measurements (no margin); None for the default guess."""
    shape: tuple[float, ...] = ()
    """The expected memory over the job (fractions of ``expected_bytes``); empty when unknown."""


@dataclass(frozen=True)
class _Estimate:
    peak: int
    wall_s: float
    shape: tuple[float, ...]
    basis: str
    derived: bool
    """From another toolchain, arch set or thread count (corrected by this build's ratios)."""


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

    def __init__(
        self, entries: list[ProfileEntry] | None = None, *, default_peak: int, margin: float = SAFETY_MARGIN
    ) -> None:
        self.default_peak = default_peak
        self.margin = margin
        self._entries: dict[JobKey, ProfileEntry] = {}
        self._by_file: dict[tuple[str, str], dict[JobKey, ProfileEntry]] = {}  # (package, source) -> entries
        self._learned_max: dict[tuple, int] = {}
        self._ratios: dict[tuple, float] = {}
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
            self._by_file.setdefault((entry.package, entry.source), {})[entry.key] = entry

    def observe(
        self, key: JobKey, anon_peak: int, wall_s: float, timeline: list[tuple[float, int, int]] | None = None
    ) -> None:
        """A finished job's real figures: they correct predictions for the rest of the build."""
        config = key.config()
        entry = ProfileEntry.measured(key, anon_peak, round(wall_s, 2), shape_of(timeline or []))
        with self._lock:
            estimate = self._estimate(key)
            if estimate is not None and estimate.derived:
                self._ratios[config] = max(self._ratios.get(config, 0.0), anon_peak / estimate.peak)
            self._learned_max[config] = max(self._learned_max.get(config, 0), anon_peak)
            self.add(entry)

    def ratio(self, key: JobKey) -> float:
        """What derived estimates in this configuration are multiplied by: finished jobs' largest ratio."""
        with self._lock:
            return max(1.0, self._ratios.get(key.config(), 1.0))

    def predict(self, key: JobKey) -> Prediction:
        with self._lock:
            estimate = self._estimate(key)
            if estimate is None:
                learned = self._learned_max.get(key.config(), 0)
                if learned * self.margin > self.default_peak:
                    learned_text = format_size(learned, "GiB")
                    return Prediction(
                        math.ceil(learned * self.margin),
                        None,
                        f"unmeasured file: largest peak of this build {learned_text} "
                        f"× {self.margin}, above the default",
                    )
                default = format_size(self.default_peak, "GiB")
                return Prediction(self.default_peak, None, f"unmeasured file: default {default}")
            peak, basis = estimate.peak, estimate.basis
            ratio = self.ratio(key)
            if estimate.derived and ratio > 1.0:
                peak = math.ceil(peak * ratio)
                basis += f" × {ratio:.2f} (this build's finished jobs against such estimates)"
        return Prediction(
            math.ceil(peak * self.margin),
            estimate.wall_s,
            f"{basis} × {self.margin} margin",
            peak,
            estimate.shape,
        )

    def _estimate(self, key: JobKey) -> _Estimate | None:
        """The job's expected peak from measurements alone (no margin, no ratio); None if none fits."""
        exact = self._entries.get(key)
        if exact is not None:
            measured = format_size(exact.anon_peak_bytes, "GiB")
            return _Estimate(
                exact.anon_peak_bytes, exact.wall_s, tuple(exact.shape), f"measured {measured}", derived=False
            )
        same_file = list(self._by_file.get((key.package, key.source), {}).values())
        if not same_file:
            return None
        nvcc = min({e.nvcc for e in same_file}, key=lambda v: (_release_distance(v, key.nvcc), v))
        candidates = [e for e in same_file if e.nvcc == nvcc]
        # The nearest configuration: the same archs in flight first, then the larger peak.
        base = min(
            candidates, key=lambda e: (abs(e.key.archs_in_flight - key.archs_in_flight), -e.anon_peak_bytes)
        )
        factor = key.archs_in_flight / base.key.archs_in_flight
        base_waves = base.key.waves
        if base_waves == 1:
            shape = tuple(base.shape) * key.waves
        else:
            shape = tuple(base.shape) if base_waves == key.waves else ()
        where = [f"nvcc {base.nvcc}"] if base.nvcc != key.nvcc else []
        if base.key.archs != key.archs or base.threads != key.threads:
            where.append(f"sm {';'.join(base.archs)} threads {base.threads}")
        basis = f"measured {format_size(base.anon_peak_bytes, 'GiB')} for {', '.join(where)}"
        if factor != 1:
            basis += f", × {factor:g} archs in flight"
        return _Estimate(
            math.ceil(base.anon_peak_bytes * factor),
            base.wall_s * key.waves / base_waves,
            shape,
            basis,
            derived=True,
        )

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
        from pipeline.contract.atomic import atomic_write_text

        entries = [asdict(e) for e in self.entries() if only_nvcc in (None, e.nvcc)]
        entries.sort(key=lambda e: (e["package"], e["nvcc"], e["archs"], e["threads"], e["source"]))
        lines = ",\n".join("  " + json.dumps(e) for e in entries)  # one measured job a line
        atomic_write_text(path, f'{{\n "note": {json.dumps(note)},\n "entries": [\n{lines}\n ]\n}}\n')


def _release_distance(release: str, other: str) -> tuple[int, int]:
    """How far apart two ``major.minor`` releases are: majors first, then minors."""
    a, b = _release(release), _release(other)
    return abs(a[0] - b[0]), abs(a[1] - b[1])


def _release(text: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text)[:2]] + [0, 0]
    return parts[0], parts[1]
