"""The chat client against servers that answer badly: retried when it may pass, one line when it cannot."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest
from rich.console import Console

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.steps.generate.client import ChatClient, PermanentError, RetriesExhausted, Retry
from pipeline.steps.generate.driver import GenerateConfig, generate
from pipeline.steps.serving.step_server import free_port

COMPLETION = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
PAYLOAD = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}]}).encode()


def http_response(status: int, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def serve(answers: list[bytes]) -> tuple[asyncio.Server, str]:
    """A loopback server that sends each connection's request the next of ``answers`` as raw bytes,
    and answers ``GET /health`` with 200."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health "):
            writer.write(http_response(200, b'{"status": "ok"}'))
            await writer.drain()
            writer.close()
            return
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        writer.write(answers.pop(0))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def client_for(*urls: str) -> ChatClient:
    return ChatClient(list(urls), concurrency=1, request_timeout_s=10, retry=Retry(base_s=0.01))


def test_a_garbled_response_is_retried():
    async def scenario():
        server, url = await serve(
            [b"NOT HTTP AT ALL\r\n\r\n", http_response(200, json.dumps(COMPLETION).encode())]
        )
        async with server, client_for(url) as client:
            data = await client.chat(PAYLOAD)
        return data, client.counters

    data, counters = asyncio.run(scenario())
    assert data["choices"][0]["message"]["content"] == "hi"
    assert counters.transient == {"client_error": 1} and counters.retries == 1


class ClosingSession:
    """A session whose first ``times`` POSTs fail as a connection closed before the answer."""

    def __init__(self, session: aiohttp.ClientSession, times: int) -> None:
        self.session, self.times = session, times

    def post(self, *args, **kwargs):
        if self.times > 0:
            self.times -= 1
            raise aiohttp.ClientConnectionError("Connection closed")
        return self.session.post(*args, **kwargs)

    def get(self, *args, **kwargs):
        return self.session.get(*args, **kwargs)

    async def close(self) -> None:
        await self.session.close()


def test_a_connection_closed_mid_request_is_retried_and_then_left_unanswered():
    async def scenario():
        server, url = await serve([http_response(200, json.dumps(COMPLETION).encode())])
        async with server, client_for(url) as client:
            client._session = ClosingSession(client.session, times=1)
            data = await client.chat(PAYLOAD)
            # Failing every time while /health answers: after the retries the row has no answer
            # (not a final one: a rerun asks it again), and the worker goes on.
            client._session.times = 100
            with pytest.raises(RetriesExhausted) as failed:
                await client.chat(PAYLOAD)
        return data, failed.value

    data, failed = asyncio.run(scenario())
    assert data["choices"][0]["message"]["content"] == "hi"
    assert failed.kind == "client_error" and "ClientConnectionError: Connection closed" in failed.reason


def test_first_model_names_the_url_of_each_problem():
    async def scenario():
        server, url = await serve([http_response(200, b"<html>not json</html>"), http_response(200, b"{}")])
        nobody = f"http://127.0.0.1:{free_port()}"
        async with server, client_for(nobody, url, url) as client:
            with pytest.raises(PermanentError) as caught:
                await client.first_model()
        return caught.value.reason, nobody, url

    reason, nobody, url = asyncio.run(scenario())
    assert reason.startswith(f"no server lists a model ({nobody}/v1/models: ClientConnectorError")
    assert f"{url}/v1/models answered no model list: b'<html>not json</html>'" in reason
    assert f"{url}/v1/models answered no model list: b'{{}}'" in reason
    assert reason.endswith("): pass --model") and "\n" not in reason


def test_the_step_says_in_one_line_when_no_model_is_listed(tmp_path):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "ok"}' if self.path == "/health" else b"not json"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    console = Console(record=True, width=400)
    try:
        code = generate(GenerateConfig(prompts=prompts, out_dir=tmp_path / "out", urls=[url]), console)
    finally:
        server.shutdown()
    said = console.export_text().strip()
    assert code == EXIT_BAD_INPUT
    listed = f"{url}/v1/models answered no model list: b'not json'"
    assert said == f"error: no server lists a model ({listed}): pass --model"
