"""Build a flash-attn wheel from its real, unmodified setup.py under a memory budget.

flash-attn's setup.py compiles one nvcc process per ``.cu`` file; each compiles
every architecture in ``FLASH_ATTN_CUDA_ARCHS`` with ``--threads $NVCC_THREADS``.
Its own job limiter runs only when MAX_JOBS is unset and reads host memory
through psutil, blind to a container's limit. Here MAX_JOBS is always set (the
limiter stays out of the way) and only sizes the look-ahead: every nvcc job goes
through the build broker, which admits it by its measured peak.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.compile.profile import SHIPPED_PROFILES, JobKey, Profile, ProfileError
from pipeline.contract.atomic import atomic_path
from pipeline.memory import GIB, Budget, format_size, memory_budget, parse_size

if TYPE_CHECKING:
    from pipeline.compile.broker import BuildBroker, BuildReport

FLASH_ATTN_VERSION = "2.8.3"
"""The release built by default: the one whose measured profiles ship (``profiles/``)."""
FLASH_ATTN_ARCHS = ("80", "90", "100", "120")
"""The architectures flash-attn 2.8.3's setup.py knows (``FLASH_ATTN_CUDA_ARCHS``)."""
DEFAULT_HEADROOM = 2 * GIB
"""Left outside the budget for what the broker does not admit: setup.py, ninja, the
waiting nvcc stand-ins, the C++ compile of flash_api.cpp (~1.5 GiB) and the link."""
DEFAULT_JOB_PEAK_PER_ARCH = 8 * GIB
"""A never-measured flash-attn TU: above the largest peak measured for one arch
(a backward kernel, ~6.6 GiB for sm_120), so an unknown file is never packed too tight."""


class BuildError(RuntimeError):
    """The build cannot go on; the message says what, where and how to fix it."""


@dataclass(frozen=True)
class NvccRelease:
    release: str
    """``major.minor``: what profiles are keyed by."""
    full: str
    """``major.minor.patch`` as ``nvcc --version`` prints it (``V13.1.80``), for notes and logs."""


def nvcc_release(nvcc: Path) -> NvccRelease:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    release = re.search(r"release (\d+\.\d+)", out)
    full = re.search(r"\bV(\d+\.\d+\.\d+)", out)
    short = release.group(1) if release else "unknown"
    return NvccRelease(short, full.group(1) if full else short)


@dataclass(frozen=True)
class Toolchain:
    python: str
    torch: str
    torch_cuda: str | None
    cuda_home: Path
    nvcc_version: str
    python_version: str
    """``major.minor`` of ``python``: the wheel's extension module works with that interpreter only."""

    @property
    def nvcc(self) -> Path:
        return self.cuda_home / "bin" / "nvcc"


@dataclass(frozen=True)
class Plan:
    version: str
    source: Path
    archs: tuple[str, ...]
    threads: int
    budget: int
    budget_basis: str
    toolchain: Toolchain
    cpu_slots: int

    @property
    def package(self) -> str:
        """What profiles key this build's jobs by (see ``JobKey.package``)."""
        return f"flash-attn {self.version}"

    def job_key(self, source: str) -> JobKey:
        """What profiles know the compile job of ``source`` in this build by."""
        return JobKey(source, self.archs, self.threads, self.toolchain.nvcc_version, self.package)

    @property
    def cache_key(self) -> str:
        cuda = self.toolchain.torch_cuda or "cpu"
        python = self.toolchain.python_version.replace(".", "")
        return (
            f"flash_attn-{self.version}-cp{python}-torch{self.toolchain.torch}-cuda{cuda}"
            f"-nvcc{self.toolchain.nvcc_version}-sm{'_'.join(self.archs)}"
        )


# -- what the host has ---------------------------------------------------------------------
def gpu_archs(nvidia_smi: str = "nvidia-smi") -> tuple[str, ...]:
    """flash-attn arch codes for this host's GPUs (``nvidia-smi --query-gpu=compute_cap``)."""
    try:
        query = [nvidia_smi, "--query-gpu=compute_cap", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise BuildError(
            f"--archs auto needs the host's GPUs, but `{nvidia_smi} --query-gpu=compute_cap` "
            f"failed ({exc.__class__.__name__}); pass the archs, e.g. --archs '100;120'"
        ) from exc
    return archs_for_compute_caps(out.split())


def archs_for_compute_caps(caps: list[str]) -> tuple[str, ...]:
    """Map compute capabilities (``12.0``) to the flash-attn arch list that runs on them."""
    archs = set()
    for cap in caps:
        major, _, minor = cap.strip().partition(".")
        if not major.isdigit():
            continue
        code = {8: "80", 9: "90", 10: "100", 11: "100", 12: "120"}.get(int(major))
        if code is None:
            raise BuildError(
                f"GPU compute capability {cap} has no flash-attn 2 build; its archs: "
                f"{';'.join(FLASH_ATTN_ARCHS)}"
            )
        archs.add(code)
    if not archs:
        raise BuildError("nvidia-smi listed no GPU; pass the archs, e.g. --archs '100;120'")
    return tuple(sorted(archs, key=int))


def parse_archs(text: str) -> tuple[str, ...]:
    if text == "auto":
        return gpu_archs()
    archs = tuple(sorted({a.strip() for a in re.split(r"[;, ]+", text) if a.strip()}, key=int))
    unknown = [a for a in archs if a not in FLASH_ATTN_ARCHS]
    if unknown or not archs:
        raise BuildError(f"--archs {text!r}: flash-attn builds only {';'.join(FLASH_ATTN_ARCHS)}")
    return archs


def toolchain(python: str, cuda_home: str | None) -> Toolchain:
    home = Path(cuda_home or os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise BuildError(f"no nvcc at {nvcc}: install a CUDA toolkit or pass --cuda-home (or CUDA_HOME)")
    script = (
        "import json, sys, torch; "
        "print(json.dumps([torch.__version__, torch.version.cuda, '%d.%d' % sys.version_info[:2]]))"
    )
    probe = subprocess.run([python, "-c", script], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(
            f"{python} cannot import torch, which flash-attn builds against ({last}); "
            "pass --python of an environment with torch"
        )
    torch_version, torch_cuda, python_version = json.loads(probe.stdout)
    return Toolchain(python, torch_version, torch_cuda, home, nvcc_release(nvcc).release, python_version)


def auto_threads(archs: tuple[str, ...], budget: int, cpus: int, per_arch_peak: int) -> int:
    """nvcc ``--threads``: one per arch when memory can keep every CPU busy that way, else 1.

    ``--threads`` parallelises over the archs of one file and multiplies its peak; with
    memory to spare it shortens the build, with memory binding it only packs fewer jobs.
    """
    jobs_by_memory = budget // max(1, per_arch_peak * len(archs))
    return len(archs) if jobs_by_memory * len(archs) >= cpus else 1


def size_option(option: str, text: str) -> int:
    """The bytes a size option (``--budget``, ``--headroom``) gives; a wrong one names itself."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise BuildError(f"{option} {text!r} is not a size: write e.g. 512MiB, 64GiB or 2GB") from exc


def resolve_budget(text: str, headroom: int, has: Budget | None = None) -> tuple[int, str, list[str]]:
    """The build's budget, where it comes from, and what to warn about.

    An explicit ``--budget`` is checked against what this process really has (``has``:
    the minimum of MemAvailable and every ancestor cgroup's headroom): above it, the
    build cgroup's limit would be a promise the host cannot keep.
    """
    has = has or memory_budget()
    available = f"{format_size(has.available, 'GiB')} (bound by {has.binding})"
    if text != "auto":
        budget = size_option("--budget", text)
        if budget <= 0:
            raise BuildError(
                f"--budget {text!r} leaves nothing to compile in: write auto or a size, e.g. 64GiB"
            )
        if budget > has.available:
            raise BuildError(
                f"--budget {text!r} is more than this process has: {available}; pass at most "
                f"{format_size(max(0, has.available - headroom), 'GiB')} (or auto: what it has less "
                f"{format_size(headroom, 'GiB')} headroom), or free memory first"
            )
        warnings = []
        if budget > has.available - headroom:
            warnings.append(
                f"--budget {text} leaves {format_size(has.available - budget, 'GiB')} of the {available} "
                f"this process has for setup.py, ninja, flash_api.cpp and the link (auto keeps "
                f"{format_size(headroom, 'GiB')})"
            )
        return budget, "given with --budget", warnings
    if has.available - headroom <= 0:
        raise BuildError(
            f"this process has {available}, less than the {format_size(headroom, 'GiB')} headroom: "
            "free memory or pass --budget"
        )
    return has.available - headroom, f"{available} − {format_size(headroom, 'GiB')} headroom", []


def environment_settings(env: Mapping[str, str], threads: str) -> tuple[str, int | None, list[str]]:
    """What ``MAX_JOBS`` and ``NVCC_THREADS`` set by the user change: (--threads, jobs cap, notes).

    flash-attn's setup.py reads both. ``NVCC_THREADS`` stands for ``--threads auto``
    (an explicit ``--threads`` wins); ``MAX_JOBS`` caps how many nvcc jobs run at once,
    each still admitted by its memory. Each note says which applied and how.
    """
    notes = []
    nvcc_threads, max_jobs = _positive_variable(env, "NVCC_THREADS"), _positive_variable(env, "MAX_JOBS")
    if nvcc_threads is not None:
        if threads == "auto":
            threads = str(nvcc_threads)
            notes.append(
                f"NVCC_THREADS={nvcc_threads} (environment): nvcc --threads {nvcc_threads}; "
                "pass --threads to choose otherwise"
            )
        elif threads != str(nvcc_threads):
            notes.append(f"--threads {threads} given: NVCC_THREADS={nvcc_threads} (environment) is not used")
    if max_jobs is not None:
        notes.append(
            f"MAX_JOBS={max_jobs} (environment): at most {max_jobs} nvcc jobs at once, each "
            "admitted by its predicted memory; setup.py's own MAX_JOBS is how many eyrie "
            "is offered at once"
        )
    return threads, max_jobs, notes


def _positive_variable(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) == 0:
        raise BuildError(f"{name}={text!r} in the environment is not a positive number: fix or unset it")
    return int(text)


# -- sources --------------------------------------------------------------------------------
def fetch_sdist(version: str, into: Path, python: str) -> Path:
    """flash-attn's sdist from PyPI, unpacked under ``into``; reused when already there."""
    target = into / f"flash_attn-{version}"
    if (target / "setup.py").is_file():
        return target
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into) as tmp:
        # Preparing metadata runs setup.py: skip its CUDA part so it needs neither nvcc nor a GPU.
        env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
        command = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        command += ["--no-build-isolation", f"flash-attn=={version}", "-d", tmp]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        archives = list(Path(tmp).glob("flash_attn-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise BuildError(
                f"could not download the flash-attn {version} sdist from PyPI: "
                f"{(done.stderr.strip().splitlines() or ['no archive'])[-1]}; "
                "pass --source DIR with an unpacked flash-attn source tree"
            )
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        shutil.move(str(Path(tmp) / f"flash_attn-{version}"), target)
    return target


def source_version(source: Path) -> str:
    init = source / "flash_attn" / "__init__.py"
    text = init.read_text(encoding="utf-8") if init.is_file() else ""
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if not match or not (source / "setup.py").is_file():
        raise BuildError(
            f"{source} is not a flash-attn source tree (no setup.py, or no __version__ in "
            "flash_attn/__init__.py): pass --source an unpacked flash-attn sdist"
        )
    return match.group(1)


def cuda_sources(source: Path) -> list[str]:
    """The ``.cu`` files the CUDA extension of this setup.py compiles, as named in it."""
    text = (source / "setup.py").read_text(encoding="utf-8")
    return sorted(set(re.findall(r'"csrc/flash_attn/src/([\w]+\.cu)"', text)))


# -- the build ------------------------------------------------------------------------------
def load_profile(archs: tuple[str, ...], threads: int, extra: list[Path] | None = None) -> Profile:
    default = DEFAULT_JOB_PEAK_PER_ARCH * min(threads, len(archs))
    try:
        return Profile.load([SHIPPED_PROFILES, *(extra or [])], default_peak=default)
    except ProfileError as exc:
        raise BuildError(f"{exc}: pass --profile a profile.json an eyrie build wrote in its run dir") from exc


def check_budget(plan: Plan, profile: Profile, sources: list[str]) -> list[str]:
    """Refuse a budget below the largest expected single job, with the numbers.

    Returns what the build should say about jobs whose prediction the budget cuts:
    they run with less than the safety margin above their expected peak.
    """
    worst, worst_file, cut = 0, "", []
    for name in sources:
        prediction = profile.predict(plan.job_key(name))
        expected = prediction.expected_bytes
        if expected is None:  # the default guess: a job never measured says nothing yet
            continue
        if expected > worst:
            worst, worst_file = expected, name
        if expected <= plan.budget < prediction.peak_bytes:
            cut.append((plan.budget / expected, name, prediction.peak_bytes, expected))
    if worst > plan.budget:
        raise BuildError(
            f"budget {format_size(plan.budget, 'GiB')} is below the expected peak of one job: {worst_file} "
            f"needs {format_size(worst, 'GiB')} for sm {';'.join(plan.archs)} with --threads {plan.threads} "
            f"(nvcc {plan.toolchain.nvcc_version}); raise --budget, lower --threads, or build fewer archs"
        )
    if not cut:
        return []
    left, name, predicted, expected = min(cut)
    return [
        f"{len(cut)} job(s) predicted above the budget run with it as their limit, less than the "
        f"{profile.margin}× safety margin: the tightest, {name}, predicted {format_size(predicted, 'GiB')} "
        f"({format_size(expected, 'GiB')} expected), gets {format_size(plan.budget, 'GiB')}, "
        f"{left:.2f}× its expected peak; "
        "each runs alone, and one OOM-killed there fails the build, naming it"
    ]


def build_env(plan: Plan, broker_env: dict[str, str], lookahead: int) -> dict[str, str]:
    return {
        **os.environ,
        **broker_env,
        "CUDA_HOME": str(plan.toolchain.cuda_home),
        "FLASH_ATTN_CUDA_ARCHS": ";".join(plan.archs),
        "NVCC_THREADS": str(plan.threads),
        # Set, so flash-attn's psutil limiter stays out; numeric, so torch passes `-j` to ninja:
        # it bounds how many nvcc stand-ins wait for admission, not how many compile.
        "MAX_JOBS": str(lookahead),
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",  # never try to download a prebuilt wheel
    }


def cxx_standard(plan: Plan) -> str | None:
    """The C++ standard to compile with when the one setup.py pins is older than torch's headers need.

    torch ≥ 2.13's headers are C++20 (2.14's ``ATen.h`` refuses anything older); flash-attn
    ≤ 2.8.3 pins ``-std=c++17`` for both nvcc and the host compiler. flash-attn's own fix
    (Dao-AILab/flash-attention#2899) compiles with C++20 for torch ≥ 2.13 and changes no
    kernel; the build does the same in the compile commands, leaving setup.py as it is.
    """
    setup = (plan.source / "setup.py").read_text(encoding="utf-8")
    major_minor = tuple(int(p) for p in re.findall(r"\d+", plan.toolchain.torch)[:2])
    if "-std=c++17" in setup and "-std=c++20" not in setup and major_minor >= (2, 13):
        return "c++20"
    return None


def write_cxx_shim(run_dir: Path, standard: str) -> Path:
    """A host compiler for torch's ninja file (``CXX``) that swaps ``-std=c++17`` for ``standard``.

    ``CXX`` must be one path (torch quotes it as a single word), hence a script, not a command line.
    """
    real = shutil.which(os.environ.get("CXX", "c++"))
    if real is None:
        raise BuildError(f"no C++ compiler {os.environ.get('CXX', 'c++')!r} on PATH: install g++ or set CXX")
    shim = run_dir / "cxx"
    shim.write_text(
        "#!/bin/sh\n"
        f"# flash-attn pins -std=c++17; torch's headers need -std={standard} (see cxx_standard)\n"
        f'for arg; do shift; [ "$arg" = -std=c++17 ] && arg=-std={standard}; set -- "$@" "$arg"; done\n'
        f'exec {real} "$@"\n',
        encoding="utf-8",
    )
    shim.chmod(0o755)
    return shim


def plan_broker(plan: Plan, *, profile: Profile, run_dir: Path, cxx_standard: str | None) -> BuildBroker:
    """The build broker of ``plan``: its toolchain's nvcc, its package, budget and CPU slots.

    The broker itself knows no ``Plan``: benchmarks drive it over a subset of files without one.
    """
    from pipeline.compile.broker import BuildBroker  # the ledger, cgroups, executors: only to build

    return BuildBroker(
        nvcc=str(plan.toolchain.nvcc),
        nvcc_version=plan.toolchain.nvcc_version,
        package=plan.package,
        profile=profile,
        budget=plan.budget,
        cpu_slots=plan.cpu_slots,
        run_dir=run_dir,
        cxx_standard=cxx_standard,
    )


def run_build(
    plan: Plan, *, out: Path, run_dir: Path, profile: Profile, log=print
) -> tuple[Path, BuildReport]:
    """Compile and link the wheel; returns its path in the cache and the build's report."""
    sources = cuda_sources(plan.source)
    for warning in check_budget(plan, profile, sources):
        log(f"note: {warning}")
    standard = cxx_standard(plan)
    # ninja offers every nvcc job at once (a waiting stand-in holds ~4.5 MiB of anonymous memory,
    # 73 of them ~330 MiB of the headroom), so the broker chooses among all of them which to run.
    lookahead = len(sources) + 1
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with (
        plan_broker(plan, profile=profile, run_dir=run_dir, cxx_standard=standard) as broker,
        tempfile.TemporaryDirectory(prefix="eyrie-wheel-") as wheel_dir,
    ):
        log(
            f"building flash-attn {plan.version} for sm {';'.join(plan.archs)}, --threads "
            f"{plan.threads}, budget {format_size(plan.budget, 'GiB')} ({plan.budget_basis}), "
            f"{len(sources)} nvcc jobs, run {broker.run_id} in {run_dir}; {broker.confinement}"
        )
        env = build_env(plan, broker.env(), lookahead)
        if standard:
            env["CXX"] = str(write_cxx_shim(run_dir, standard).resolve())  # setup.py runs in the source tree
            log(
                f"torch {plan.toolchain.torch}'s headers need {standard}: compiling with -std={standard} "
                "where flash-attn's setup.py asks for -std=c++17"
            )
        setup_log = run_dir / "setup.log"
        returncode = _run_setup(plan, broker, env, wheel_dir, setup_log, len(sources))
        report = broker.report()
        note = f"measured by run {broker.run_id}"
        profile.save(run_dir / "profile.json", note=note, only_nvcc=plan.toolchain.nvcc_version)
        wheels = list(Path(wheel_dir).glob("flash_attn-*.whl"))
        if returncode != 0 or not wheels:
            reason = broker.fatal or _last_error(setup_log)
            raise BuildError(
                f"the flash-attn build failed: {reason}; full log: {setup_log}; "
                f"per-job attempts: eyrie status --run-dir {run_dir}"
            )
        wheel = _cache_wheel(plan, wheels[0], out, report, broker.run_id, started)
    return wheel, report


def _run_setup(
    plan: Plan, broker: BuildBroker, env: dict[str, str], wheel_dir: str, setup_log: Path, jobs: int
) -> int:
    """Run setup.py (through ``pip wheel``) to its end, its output into ``setup_log`` and the
    progress of its ``jobs`` nvcc jobs on the terminal; returns its exit status."""
    command = [plan.toolchain.python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps"]
    command += ["--wheel-dir", wheel_dir, "--verbose", str(plan.source)]
    columns = [TextColumn("nvcc jobs"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}")]
    with (
        open(setup_log, "w", encoding="utf-8") as fh,
        Progress(*columns, TimeElapsedColumn(), transient=False) as progress,
    ):
        task = progress.add_task("", total=jobs)
        setup = subprocess.Popen(command, env=env, stdout=fh, stderr=subprocess.STDOUT)
        while setup.poll() is None:
            time.sleep(1)
            report = broker.report()
            done_jobs = sum(j.exit_code == 0 for j in report.jobs)
            reserved = format_size(broker.scheduler.reserved, "GiB")
            description = (
                f"{reserved} of {format_size(plan.budget, 'GiB')} reserved, "
                f"{len(broker.scheduler.running)} running, {report.oom_kills} OOM-killed and re-run"
            )
            progress.update(task, completed=done_jobs, description=description)
    return setup.returncode


def _cache_wheel(
    plan: Plan, wheel: Path, out: Path, report: BuildReport, run_id: str, started: float
) -> Path:
    """Put the wheel in the cache under the plan's key, beside ``build.json``: the plan and how it built."""
    target_dir = out / plan.cache_key
    with atomic_path(target_dir) as tmp:
        tmp.mkdir()
        shutil.copy2(wheel, tmp / wheel.name)
        facts = {
            **asdict(plan),
            "wall_s": round(time.time() - started, 1),
            "oom_kills": report.oom_kills,
            "jobs": len(report.jobs),
            "peak_reserved": report.peak_reserved,
            "run_id": run_id,
        }
        (tmp / "build.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
    return target_dir / wheel.name


def cached_wheel(out: Path, plan_key: str) -> Path | None:
    wheels = sorted((out / plan_key).glob("flash_attn-*.whl"))
    return wheels[0] if wheels else None


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines()]
    for line in reversed(lines):
        if "error" in line.lower() and line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
