"""`eyrie generate` vs `sglang.bench_serving` against the same SGLang server (a GPU host).

Both clients send the same single-turn prompts to ``/v1/chat/completions`` at the
same concurrency, greedy, with the same max_tokens, non-streaming, stopping at EOS:
if the driver keeps up with the reference client, it is not the bottleneck. Both report
the E2E request latency percentiles (p50 is bench_serving's median).

    # on a GPU host with sglang installed (the images/sglang image has it)
    python -m benchmarks.generate_sglang_compare --model Qwen/Qwen3-8B --launch \\
        --prompts runs/default/prep/prompts.jsonl --num-prompts 1000 --concurrency 1 8 32 128

``--launch`` starts ``python -m sglang.launch_server`` on a free port and stops it
after; without it, give ``--url`` of a running server (or sglang-router).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def single_turn_prompts(source: Path, count: int, out_jsonl: Path, out_sharegpt: Path) -> int:
    """The first user turn of each prompt row, as eyrie prompts and as a ShareGPT file for bench_serving."""
    rows = []
    with open(source) as fh:
        for line in fh:
            row = json.loads(line)
            first = next((m for m in row["messages"] if m["role"] == "user"), None)
            if first and isinstance(first.get("content"), str) and len(first["content"]) >= 16:
                rows.append((row["id"], first["content"]))
            if len(rows) >= count:
                break
    with open(out_jsonl, "w") as fh:
        for row_id, text in rows:
            fh.write(
                json.dumps({"id": row_id, "source": "bench", "messages": [{"role": "user", "content": text}]})
                + "\n"
            )
    # bench_serving's sharegpt loader takes the first human turn as the prompt; the gpt turn's
    # length is overridden by --sharegpt-output-len.
    sharegpt = [
        {
            "id": row_id,
            "conversations": [
                {"from": "human", "value": text},
                {"from": "gpt", "value": "placeholder answer"},
            ],
        }
        for row_id, text in rows
    ]
    out_sharegpt.write_text(json.dumps(sharegpt))
    return len(rows)


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"sglang.launch_server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"{url} was not healthy after {timeout_s:.0f}s")


def run_eyrie(url: str, prompts: Path, out: Path, concurrency: int, max_tokens: int) -> dict:
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "generate",
        str(prompts),
        "--url",
        url,
        "--out-dir",
        str(out),
        "--concurrency",
        str(concurrency),
        "--max-tokens",
        str(max_tokens),
        "--temperature",
        "0",
    ]
    subprocess.run(argv, cwd=REPO, check=True)
    attempt = json.loads((out / "manifest.json").read_text())["stats"]["this_attempt"]
    latency = attempt["e2e_latency_ms"]
    return {
        "req_per_s": attempt["req_per_s"],
        "tok_out_per_s": attempt["tok_out_per_s"],
        "p50_ms": latency["p50"],
        "p99_ms": latency["p99"],
    }


def run_bench_serving(
    url: str, sharegpt: Path, count: int, out: Path, concurrency: int, max_tokens: int
) -> dict:
    argv = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang-oai-chat",
        "--base-url",
        url,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(sharegpt),
        "--num-prompts",
        str(count),
        "--sharegpt-output-len",
        str(max_tokens),
        "--max-concurrency",
        str(concurrency),
        "--disable-stream",
        "--disable-ignore-eos",
        "--output-file",
        str(out),
    ]
    subprocess.run(argv, check=True)
    result = json.loads(out.read_text().splitlines()[-1])
    return {
        "req_per_s": result["request_throughput"],
        "tok_out_per_s": result["output_throughput"],
        "p50_ms": result["median_e2e_latency_ms"],
        "p99_ms": result["p99_e2e_latency_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model path or hub id the server serves")
    parser.add_argument("--prompts", type=Path, required=True, help="prompts.jsonl from the prep step")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--url", default=None, help="a running server; else --launch")
    parser.add_argument("--launch", action="store_true", help="start sglang.launch_server for the run")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    if bool(args.url) == args.launch:
        parser.error("give --url of a running server, or --launch")

    with tempfile.TemporaryDirectory(prefix="eyrie-bench-sglang-") as tmp:
        root = Path(tmp)
        count = single_turn_prompts(
            args.prompts, args.num_prompts, root / "prompts.jsonl", root / "sharegpt.json"
        )
        server = None
        url = args.url
        if args.launch:
            port = 30000 + (int(time.time()) % 1000)
            url = f"http://127.0.0.1:{port}"
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang.launch_server",
                    "--model-path",
                    args.model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--tp",
                    str(args.tp),
                ]
            )
        try:
            wait_healthy(url, 1800, server)
            rows = []
            for concurrency in args.concurrency:
                ours = run_eyrie(
                    url, root / "prompts.jsonl", root / f"eyrie-c{concurrency}", concurrency, args.max_tokens
                )
                ref = run_bench_serving(
                    url,
                    root / "sharegpt.json",
                    count,
                    root / f"bench-c{concurrency}.jsonl",
                    concurrency,
                    args.max_tokens,
                )
                rows.append((concurrency, ours, ref))
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=120)
    print(f"{count} prompts, max_tokens {args.max_tokens}, model {args.model}")
    print("| concurrency | req/s | out tok/s | E2E latency p50 ms | E2E latency p99 ms |")
    print("|---|---|---|---|---|")
    for concurrency, ours, ref in rows:
        cells = [
            f"{ours[k]:.2f} / {ref[k]:.2f}" if k == "req_per_s" else f"{ours[k]:.0f} / {ref[k]:.0f}"
            for k in ("req_per_s", "tok_out_per_s", "p50_ms", "p99_ms")
        ]
        print(f"| {concurrency} | " + " | ".join(cells) + " |")
    print("(each cell: eyrie generate / sglang.bench_serving)")


if __name__ == "__main__":
    main()
