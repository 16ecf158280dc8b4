"""A fake OpenAI-compatible chat server for tests and benchmarks, with faults on demand.

A real aiohttp HTTP server on loopback that answers ``/v1/chat/completions``
instantly with a deterministic answer, and can be told to misbehave: answer 5xx or
429 for a fraction of requests, be slow, drop the connection without answering,
die (``os._exit``) after N answers, have an outage after N answers (500 to every
chat for S seconds, ``/health`` too with ``--outage-health``, then exit or recover),
reject marked prompts with a 400, cut marked prompts at ``length``, return
``reasoning_content`` or ``tool_calls``, answer with text that is not valid Unicode,
demand an API key, list another model name. It prints ``PORT <n>`` once listening.
``--record`` appends each request body to a JSONL file so tests can check what the
driver sent.

    python tests/fakes/fake_openai_server.py --port 0 --error-rate 500:0.2 --drop-rate 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import sys

from aiohttp import web

MODEL = "fake-target"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--error-rate",
        action="append",
        default=[],
        help="STATUS:FRACTION, e.g. 500:0.1 or 429:0.05 (repeatable)",
    )
    p.add_argument("--drop-rate", type=float, default=0.0, help="close the connection unanswered")
    p.add_argument("--slow-rate", type=float, default=0.0)
    p.add_argument("--slow-s", type=float, default=0.5)
    p.add_argument("--die-after", type=int, default=0, help="exit abruptly after N answers")
    p.add_argument("--outage-after", type=int, default=0, help="after N answers, 500 to every chat")
    p.add_argument("--outage-s", type=float, default=5.0, help="for this long, then --outage-then")
    p.add_argument("--outage-then", choices=["exit", "recover"], default="recover")
    p.add_argument("--outage-health", action="store_true", help="/health answers 503 during the outage")
    p.add_argument("--model", default=MODEL, help="the model name /v1/models lists")
    p.add_argument("--hollow-rate", type=float, default=0.0, help="200 whose body holds no completion")
    p.add_argument("--hollow-marker", default="HOLLOW", help="always a 200 without a completion")
    p.add_argument("--surrogate-marker", default="BAD-UNICODE", help="answer with a lone surrogate")
    p.add_argument("--reject-marker", default="REJECT-ME", help="400 when a message contains it")
    p.add_argument("--length-marker", default="CUT-ME", help="finish_reason=length when present")
    p.add_argument("--reasoning", action="store_true", help="return reasoning_content")
    p.add_argument("--tool-marker", default="CALL-A-TOOL", help="answer with tool_calls when present")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--record", default=None, help="append every request body to this JSONL file")
    return p.parse_args(argv)


def answer_for(messages: list[dict]) -> str:
    """The fake model's answer: a digest of the whole history, so tests can tell what it saw."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12]
    turns = sum(1 for m in messages if m.get("role") == "assistant")
    return f"answer-{digest} after {turns} assistant turns"


def make_app(args: argparse.Namespace) -> web.Application:
    rng = random.Random(args.seed)
    errors = [(int(s), float(f)) for s, f in (e.split(":") for e in args.error_rate)]
    state = {"answered": 0, "outage": False}
    record = open(args.record, "a", encoding="utf-8") if args.record else None  # noqa: SIM115

    def authorized(request: web.Request) -> bool:
        return args.api_key is None or request.headers.get("Authorization") == f"Bearer {args.api_key}"

    def end_outage() -> None:
        if args.outage_then == "exit":
            os._exit(18)
        state["outage"] = False

    async def health(request: web.Request) -> web.Response:
        if args.outage_health and state["outage"]:
            return web.json_response({"status": "unhealthy"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        if not authorized(request):
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        body = await request.json()
        if record:
            record.write(json.dumps(body) + "\n")
            record.flush()
        if state["outage"]:
            return web.json_response({"error": {"message": "injected outage"}}, status=500)
        roll = rng.random()
        for status, fraction in errors:
            if roll < fraction:
                return web.json_response({"error": {"message": f"injected {status}"}}, status=status)
            roll -= fraction
        if rng.random() < args.drop_rate:
            request.transport.close()  # the client sees the connection end without an answer
            return web.Response(status=500)
        if rng.random() < args.slow_rate:
            await asyncio.sleep(args.slow_s)
        messages = body["messages"]
        text = json.dumps(messages)
        if rng.random() < args.hollow_rate or args.hollow_marker in text:
            return web.json_response({"object": "chat.completion", "choices": []})
        if args.reject_marker in text:
            return web.json_response(
                {"error": {"message": "prompt rejected: contains the reject marker", "type": "BadRequest"}},
                status=400,
            )
        content = answer_for(messages)
        if args.surrogate_marker in text:
            content += " \ud800"  # sent as the JSON escape; decodes to text that is not valid Unicode
        message: dict = {"role": "assistant", "content": content}
        if args.reasoning:
            message["reasoning_content"] = f"thinking about {content[7:19]}"
        last = messages[-1].get("content")
        if isinstance(last, str) and args.tool_marker in last:
            call = {"name": "lookup", "arguments": json.dumps({"q": "x"})}
            message["tool_calls"] = [{"id": "call_1", "type": "function", "function": call}]
        finish = "tool_calls" if "tool_calls" in message else "stop"
        if args.length_marker in text:
            finish = "length"
        prompt_tokens = len(text.split())
        response = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": body.get("model", MODEL),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(content.split()),
                "total_tokens": prompt_tokens + len(content.split()),
            },
        }
        state["answered"] += 1
        if args.die_after and state["answered"] > args.die_after:
            os._exit(17)  # sudden death: no answer, every connection reset
        if args.outage_after and state["answered"] == args.outage_after:
            state["outage"] = True
            asyncio.get_running_loop().call_later(args.outage_s, end_outage)
        return web.json_response(response)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main() -> None:
    args = parse_args()
    # Bind first, so the port printed is the one listening (port 0: the kernel picks).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    web.run_app(make_app(args), sock=sock, access_log=None, print=None, handle_signals=True)


if __name__ == "__main__":
    sys.exit(main())
