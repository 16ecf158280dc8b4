"""Driver overhead: `eyrie generate` against a server that answers instantly.

The server is the fake OpenAI server of the tests (aiohttp, no model): every
request is answered at once, so the rate measured is the driver's own ceiling.
Reports completed requests/s over the generation phase (after the health wait,
including writing and fsyncing conversations.jsonl) and the CPU the driver and
the server used. ``--httpx`` also measures a bare httpx AsyncClient loop against
the same server, for the client-library choice in pipeline/steps/generate/client.py.

On a shared machine the kernel's autogroup scheduler gives each session an equal
share of the CPU whatever its processes' nice values, so the rate measured is the
machine's fair share rather than the driver's; ``--priority`` (root) raises this
session's autogroup weight (nice -20) for the run and restores it afterwards.

    .venv/bin/python -m benchmarks.generate_overhead --rows 20000 --concurrency 64 --httpx --priority
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
FAKE_SERVER = REPO / "tests" / "fakes" / "fake_openai_server.py"


AUTOGROUP = Path("/proc/self/autogroup")


def set_autogroup_nice(nice: int) -> int:
    """Set this session's autogroup nice value; returns the previous one."""
    previous = int(AUTOGROUP.read_text().split("nice")[1])
    AUTOGROUP.write_text(str(nice))
    return previous


def start_server(pin: str | None) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, str(FAKE_SERVER), "--port", "0"]
    if pin:
        argv = ["taskset", "-c", pin, *argv]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(process.stdout.readline().split()[1])
    return process, f"http://127.0.0.1:{port}"


def write_prompts(path: Path, rows: int) -> None:
    with open(path, "w") as fh:
        for i in range(rows):
            message = {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}
            fh.write(json.dumps({"id": f"b{i:07d}", "source": "bench", "messages": [message]}) + "\n")


def run_driver(prompts: Path, out: Path, url: str, concurrency: int, pin: str | None) -> dict:
    argv = [sys.executable, "-m", "pipeline.cli", "generate", str(prompts), "--url", url,
            "--concurrency", str(concurrency), "--out-dir", str(out)]  # fmt: skip
    if pin:
        argv = ["taskset", "-c", pin, *argv]
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read()
    if process.returncode != 0:
        raise SystemExit(f"eyrie generate failed ({process.returncode}): {stderr.strip()[-500:]}")
    stats = json.loads((out / "manifest.json").read_text())["stats"]["this_attempt"]
    return {
        "wall_total_s": time.monotonic() - started,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_mib": usage.ru_maxrss / 1024,
        **stats,
    }


async def httpx_loop(url: str, rows: int, concurrency: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(rows):
            queue.put_nowait({"model": "m", "messages": [{"role": "user", "content": f"q {i}"}]})

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                (await client.post(url + "/v1/chat/completions", json=body)).json()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--pin", action="store_true", help="driver on CPU 0, server on CPU 1")
    parser.add_argument("--httpx", action="store_true", help="also time a bare httpx client loop")
    parser.add_argument("--priority", action="store_true", help="this session's autogroup at nice -20")
    args = parser.parse_args()
    previous_nice = set_autogroup_nice(-20) if args.priority else None
    try:
        measure(args)
    finally:
        if previous_nice is not None:
            set_autogroup_nice(previous_nice)


def measure(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; priority={args.priority}")

    with tempfile.TemporaryDirectory(prefix="eyrie-bench-gen-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(prompts, args.rows)
        server, url = start_server("1" if args.pin else None)
        try:
            server_cpu = psutil.Process(server.pid).cpu_times()
            result = run_driver(prompts, Path(tmp) / "out", url, args.concurrency, "0" if args.pin else None)
            after = psutil.Process(server.pid).cpu_times()
            server_cpu_s = (after.user + after.system) - (server_cpu.user + server_cpu.system)
            rps = result["requests"] / result["wall_s"]
            print(f"eyrie generate: {result['requests']} requests, concurrency {args.concurrency}, "
                  f"pinned={args.pin}")  # fmt: skip
            print(f"  {rps:,.0f} completed requests/s over {result['wall_s']:.2f} s of generation "
                  f"({result['wall_total_s']:.2f} s with startup, health wait and manifest)")  # fmt: skip
            per_request_us = 1e6 * result["cpu_s"] / result["requests"]
            print(f"  driver CPU {result['cpu_s']:.2f} s ({per_request_us:.0f} µs "
                  f"per request incl. startup), max RSS {result['max_rss_mib']:.0f} MiB; "
                  f"server CPU {server_cpu_s:.2f} s")  # fmt: skip
            if args.httpx:
                rows = min(args.rows, 5000)
                before = time.process_time()
                wall = asyncio.run(httpx_loop(url, rows, args.concurrency))
                cpu = time.process_time() - before
                print(f"bare httpx AsyncClient: {rows / wall:,.0f} requests/s, "
                      f"{1e6 * cpu / rows:.0f} µs CPU per request ({rows} requests)")  # fmt: skip
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
