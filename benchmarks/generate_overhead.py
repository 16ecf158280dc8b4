"""Driver overhead: `eyrie generate` beside bare aiohttp clients, against a server that answers at once.

The server is the fake OpenAI server of the tests (aiohttp, no model): every
request is answered at once, so the rate measured is a client's own ceiling.
Three clients take turns against the same server, on the same prompts, at the
same concurrency:

- ``bare``: the least a client can do: an aiohttp session, ``concurrency``
  workers posting each prompt's messages (``json=``) and parsing the JSON answer
  (``response.json()``), every prompt read into memory beforehand, nothing
  written.
- ``bare-orjson``: the same with orjson for the request and the answer, as the
  driver does: what separates it from ``eyrie`` is the driver's own work.
- ``eyrie``: ``eyrie generate`` as a subprocess, its whole work: reading the
  prompts, the requests, the rows written and fsynced, the manifest.
- ``bare-httpx`` (with ``--httpx``): ``bare`` on httpx's AsyncClient, for the
  client-library choice in pipeline/steps/generate/client.py.

Each is measured over its request phase (from the first request to the last
answer; for ``eyrie generate`` the manifest's ``this_attempt`` figures) and as a
whole process (startup included, from the children's rusage). Every turn runs
each client once, in a rotating order; a turn's ratios compare clients that ran
back to back, and the table gives the median of the turns (and their range). All
clients use uvloop when it is installed, as ``eyrie generate`` does.

``--instructions`` counts each client's user-space instructions under valgrind
(callgrind) for N and 2N prompts: their difference over N is the cost of one
request, whatever else the machine is doing; what is left of the N-prompt count
is the startup and the end (imports, the manifest).

With ``--pin`` the clients run on CPU 0 and the server on CPU 1, so a client's rate
is its own ceiling rather than its share of the CPUs it splits with the server.

On a shared machine the kernel's autogroup scheduler gives each session an equal
share of the CPU whatever its processes' nice values; ``--priority`` (root)
raises this session's autogroup weight (nice -20) for the run and restores it
afterwards.

    .venv/bin/python -m benchmarks.generate_overhead --rows 20000 --concurrency 64 --repeats 7 --priority
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKE_SERVER = REPO / "tests" / "fakes" / "fake_openai_server.py"
AUTOGROUP = Path("/proc/self/autogroup")
CLIENTS = ["bare", "bare-orjson", "eyrie"]


def set_autogroup_nice(nice: int) -> int:
    """Set this session's autogroup nice value; returns the previous one."""
    previous = int(AUTOGROUP.read_text().split("nice")[1])
    AUTOGROUP.write_text(str(nice))
    return previous


def pinned(argv: list[str], cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu, *argv] if cpu else argv


def start_server(cpu: str | None) -> tuple[subprocess.Popen, str]:
    argv = pinned([sys.executable, str(FAKE_SERVER), "--port", "0"], cpu)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(process.stdout.readline().split()[1])
    return process, f"http://127.0.0.1:{port}"


def write_prompts(path: Path, rows: int) -> None:
    with open(path, "w") as fh:
        for i in range(rows):
            message = {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}
            fh.write(json.dumps({"id": f"b{i:07d}", "source": "bench", "messages": [message]}) + "\n")


def cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# -- the bare clients: `python -m benchmarks.generate_overhead bare|bare-orjson|bare-httpx URL PROMPTS N` ----
async def httpx_client(url: str, bodies: list[dict], concurrency: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    chat = url + "/v1/chat/completions"
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        rows = iter(bodies)

        async def worker() -> None:
            for body in rows:
                answer = (await client.post(chat, json=body)).json()
                answer["choices"][0]["message"]  # noqa: B018  (parsed, then dropped)

        cpu, started = cpu_s(resource.RUSAGE_SELF), time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - started
        return {"wall_s": wall, "cpu_s": cpu_s(resource.RUSAGE_SELF) - cpu, "requests": len(bodies)}


async def bare_client(url: str, bodies: list[dict], concurrency: int, fast_json: bool) -> dict:
    import aiohttp
    import orjson

    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    headers = {"Content-Type": "application/json"}
    chat = url + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=connector) as session:
        rows = iter(bodies)

        async def worker() -> None:
            for body in rows:
                if fast_json:
                    async with session.post(chat, data=orjson.dumps(body), headers=headers) as response:
                        answer = orjson.loads(await response.read())
                else:
                    async with session.post(chat, json=body) as response:
                        answer = await response.json()
                answer["choices"][0]["message"]  # noqa: B018  (parsed, then dropped)

        cpu, started = cpu_s(resource.RUSAGE_SELF), time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - started
        return {"wall_s": wall, "cpu_s": cpu_s(resource.RUSAGE_SELF) - cpu, "requests": len(bodies)}


def bare_main(name: str, url: str, prompts: Path, concurrency: int) -> None:
    bodies = []
    with open(prompts, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            bodies.append({"model": "fake-target", "messages": row["messages"], "max_tokens": 2048})
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if name == "bare-httpx":
        print(json.dumps(run(httpx_client(url, bodies, concurrency))))
    else:
        print(json.dumps(run(bare_client(url, bodies, concurrency, fast_json=name == "bare-orjson"))))


# -- the turns ----------------------------------------------------------------------------------------------
def client_argv(name: str, url: str, prompts: Path, out: Path, concurrency: int) -> list[str]:
    if name == "eyrie":
        return [
            sys.executable,
            "-m",
            "pipeline.cli",
            "generate",
            str(prompts),
            "--url",
            url,
            "--concurrency",
            str(concurrency),
            "--out-dir",
            str(out),
        ]
    module = "benchmarks.generate_overhead"
    return [sys.executable, "-m", module, name, url, str(prompts), str(concurrency)]


def run_quietly(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    process = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if process.returncode != 0:
        raise SystemExit(f"{name} failed ({process.returncode}): {process.stderr.strip()[-800:]}")
    return process


def run_client(name: str, url: str, prompts: Path, out: Path, concurrency: int, cpu: str | None) -> dict:
    """One client's run: its request-phase figures and its whole process's wall and CPU time."""
    argv = pinned(client_argv(name, url, prompts, out, concurrency), cpu)
    children_cpu, started = cpu_s(resource.RUSAGE_CHILDREN), time.monotonic()
    process = run_quietly(name, argv)
    wall = time.monotonic() - started
    if name == "eyrie":
        attempt = json.loads((out / "manifest.json").read_text())["stats"]["this_attempt"]
        phase = {k: attempt[k] for k in ("wall_s", "cpu_s", "requests")}
    else:
        phase = json.loads(process.stdout)
    return {**phase, "process_wall_s": wall, "process_cpu_s": cpu_s(resource.RUSAGE_CHILDREN) - children_cpu}


def figures(result: dict) -> dict[str, float]:
    n = result["requests"]
    return {
        "rps": n / result["wall_s"],
        "cpu_us": 1e6 * result["cpu_s"] / n,
        "process_rps": n / result["process_wall_s"],
        "process_cpu_us": 1e6 * result["process_cpu_s"] / n,
    }


COLUMNS = {
    "rps": "req/s",
    "cpu_us": "CPU µs/request",
    "process_rps": "req/s",
    "process_cpu_us": "CPU µs/request",
}


def instructions(name: str, url: str, prompts: Path, out: Path, concurrency: int) -> int:
    """User-space instructions of one client's whole process, counted by valgrind's callgrind."""
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    process = run_quietly(name, valgrind + client_argv(name, url, prompts, out, concurrency))
    return int(re.search(r"Collected : (\d+)", process.stderr).group(1))


def count_instructions(args: argparse.Namespace) -> None:
    """Instructions per request, free of the machine's load: (count at 2N prompts - at N) / N."""
    print(
        f"instructions per request (callgrind), {args.rows} and {2 * args.rows} prompts, "
        f"concurrency {args.concurrency}"
    )
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-gen-") as tmp:
        sizes = {n: Path(tmp) / f"prompts-{n}.jsonl" for n in (args.rows, 2 * args.rows)}
        for n, path in sizes.items():
            write_prompts(path, n)
        server, url = start_server(None)
        try:
            counts = {
                name: [
                    instructions(name, url, path, Path(tmp) / f"out-{name}-{n}", args.concurrency)
                    for n, path in sizes.items()
                ]
                for name in CLIENTS
            }
        finally:
            server.kill()
            server.wait()
    per_request = {name: (big - small) / args.rows for name, (small, big) in counts.items()}
    print("| client | instructions per request | startup and end (instructions) |")
    print("|---|---|---|")
    for name, (small, _) in counts.items():
        print(f"| {name} | {per_request[name]:,.0f} | {small - args.rows * per_request[name]:,.0f} |")
    for base in ("bare", "bare-orjson"):
        print(f"| eyrie / {base} | {per_request['eyrie'] / per_request[base]:.2f}× | |")


def measure(args: argparse.Namespace) -> None:
    print(
        f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"priority={args.priority}, pinned={args.pin}; {args.rows} prompts, "
        f"concurrency {args.concurrency}, {args.repeats} turns"
    )
    clients = CLIENTS + ["bare-httpx"] if args.httpx else CLIENTS
    turns: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-gen-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(prompts, args.rows)
        server, url = start_server("1" if args.pin else None)
        try:
            for turn in range(args.repeats):
                # Rotate which goes first, so a drift in the machine's load hits every client alike.
                shift = turn % len(clients)
                results = {}
                for name in clients[shift:] + clients[:shift]:
                    out = Path(tmp) / f"out-{turn}"
                    result = run_client(name, url, prompts, out, args.concurrency, "0" if args.pin else None)
                    results[name] = figures(result)
                turns.append(results)
                print(
                    f"  turn {turn + 1}: "
                    + "; ".join(
                        f"{name} {f['rps']:,.0f} req/s {f['cpu_us']:.0f} µs" for name, f in results.items()
                    ),
                    flush=True,
                )
        finally:
            server.kill()
            server.wait()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        "| client | req/s, request phase | CPU µs/request, request phase | req/s, process "
        "| CPU µs/request, process |"
    )
    print("|---|---|---|---|---|")
    for name in clients:
        cells = [f"{statistics.median(t[name][key] for t in turns):,.0f}" for key in COLUMNS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for base in ("bare", "bare-orjson"):
        cells = []
        for key in COLUMNS:
            ratios = [t["eyrie"][key] / t[base][key] for t in turns]
            cells.append(f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})")
        print(f"| eyrie / {base} | " + " | ".join(cells) + " |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("bare", "bare-orjson", "bare-httpx"):
        bare_main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="turns; each runs every client once")
    parser.add_argument("--priority", action="store_true", help="this session's autogroup at nice -20")
    parser.add_argument("--pin", action="store_true", help="clients on CPU 0, the server on CPU 1")
    parser.add_argument("--httpx", action="store_true", help="also a bare httpx AsyncClient (slow)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per request under valgrind instead (--rows N: runs of N and 2N)",
    )
    args = parser.parse_args()
    if args.instructions:
        count_instructions(args)
        return
    previous_nice = set_autogroup_nice(-20) if args.priority else None
    try:
        measure(args)
    finally:
        if previous_nice is not None:
            set_autogroup_nice(previous_nice)


if __name__ == "__main__":
    main()
