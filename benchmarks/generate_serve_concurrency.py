"""The generation step's throughput against `transformers serve` on the tiny target, by concurrency.

The embedded default's real path: the tiny target (pipeline/embedded/tiny.py) served
by the Hugging Face server on the CPU, the real driver in front of it. The same
single-turn prompts (first user turns of the bundled samples) are sent at each
concurrency, greedy, with a fixed max_tokens, after one warm-up request; once with
the server's default (one request decoded at a time) and once with
``--continuous-batching`` (requests in flight decoded together).

    .venv/bin/python -m benchmarks.generate_serve_concurrency --prompts 24 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console

from pipeline.embedded.tiny import ensure_tiny_target, sample_conversations
from pipeline.steps.generate.config import GenerateConfig, Sampling
from pipeline.steps.generate.driver import generate
from pipeline.steps.serving.step_server import transformers_serve


def write_prompts(path: Path, count: int) -> None:
    firsts = [c[0] for c in sample_conversations() if c and c[0]["role"] == "user" and c[0]["content"]]
    if len(firsts) < count:
        raise SystemExit(f"only {len(firsts)} sample prompts; ask for fewer")
    with open(path, "w") as fh:
        for i, message in enumerate(firsts[:count]):
            content = str(message["content"])[:1000]
            fh.write(
                json.dumps(
                    {
                        "id": f"s{i:04d}",
                        "source": "samples",
                        "messages": [{"role": "user", "content": content}],
                    }
                )
                + "\n"
            )


def warm_up(url: str, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    request = urllib.request.Request(
        url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=300).read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="eyrie-bench-serve-") as tmp:
        root = Path(tmp)
        model = ensure_tiny_target(root / "model")
        prompts = root / "prompts.jsonl"
        write_prompts(prompts, args.prompts)
        rows = []
        for batching in (False, True):
            with transformers_serve(model, root / "serve.log", continuous_batching=batching) as url:
                warm_up(url, str(model))
                rows += [(batching, *run) for run in sweep(url, model, prompts, root, args)]
        print("| server | concurrency | requests | req/s | output tok/s | output tokens | wall s |")
        print("|---|---|---|---|---|---|---|")
        for batching, concurrency, requests, rps, tps, tokens, wall in rows:
            server = "continuous batching" if batching else "default"
            print(
                f"| {server} | {concurrency} | {requests} | {rps:.2f} | {tps:.1f} | {tokens} | {wall:.1f} |"
            )


def sweep(url: str, model: Path, prompts: Path, root: Path, args: argparse.Namespace) -> list[tuple]:
    quiet = Console(stderr=True, quiet=True)
    rows = []
    for concurrency in args.concurrency:
        out = root / f"out-{url.rsplit(':', 1)[1]}-c{concurrency}"
        config = GenerateConfig(
            prompts=prompts,
            out_dir=out,
            urls=[url],
            model=str(model),
            concurrency=concurrency,
            sampling=Sampling(temperature=0.0, max_tokens=args.max_tokens),
        )
        started = time.monotonic()
        if generate(config, quiet) != 0:
            raise SystemExit(f"generation failed at concurrency {concurrency}; see {root}/serve.log")
        wall = time.monotonic() - started
        stats = json.loads((out / "manifest.json").read_text())["stats"]
        attempt = stats["this_attempt"]
        rows.append(
            (
                concurrency,
                attempt["requests"],
                attempt["req_per_s"],
                attempt["tok_out_per_s"],
                stats["tokens_out"],
                wall,
            )
        )
    return rows


if __name__ == "__main__":
    main()
