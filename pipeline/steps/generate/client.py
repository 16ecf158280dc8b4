"""Chat requests to one or more OpenAI-compatible servers (SGLang, sglang-router, transformers serve).

aiohttp, not httpx: against a server that answers at once, httpx's AsyncClient spent
~2.7 ms of CPU per request on the 2-core test machine and aiohttp ~0.1 ms
(benchmarks/README.md); it is also what ``sglang.bench_serving`` uses.

Each request goes to the live server with the fewest requests outstanding. A failure
that a later attempt may not repeat (connection refused or reset, timeout, 429, 5xx,
any other HTTP client error such as a garbled response, a 200 whose body holds no
chat completion) is transient, and what it costs depends on whether the server
still answers ``/health``:

- It does: the failure is the request's. It is retried with exponential backoff and
  full jitter, ``Retry.max_retries`` times; after that the request is left unanswered
  (``RetriesExhausted``), never given a final answer, so a rerun asks it again.
- It does not: the server is down, and the failure says nothing about the request.
  Requests go to the other servers, or wait while none is up, without spending their
  retries; ``/health`` is polled until the server is back. A server down for longer
  than the patience is given up; when every server is given up the run stops
  (``ServersDead``).

Any other 4xx is the server's final answer for that request (``PermanentError``, with
its message), except 401/403, which stop the run (``AuthError``).
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pipeline.steps.generate.json_text import loads
from pipeline.steps.serving.http_retry import TRANSIENT_STATUS, Retry

CHAT_PATH = "/v1/chat/completions"
# A probe of /health (SGLang, transformers serve) that takes longer than this counts as no answer.
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10)


class PermanentError(Exception):
    """The server rejected this request; retrying the same request will not help."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class RetriesExhausted(Exception):
    """A live server kept failing this request transiently: no answer yet, but not a final one."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class ServersDead(Exception):
    """No server answered ``/health`` within the patience; the run must stop."""


class HealthTimeout(Exception):
    pass


class AuthError(Exception):
    """The server refused the credentials: no row can succeed, so the run stops."""


_AUTH_HINT = "give the API key with --api-key-env or --api-key-file"


@dataclass
class Server:
    url: str
    outstanding: int = 0
    down_since: float | None = None
    """Monotonic time this server stopped answering ``/health``; None while it answers."""
    given_up: bool = False
    last_error: str = ""
    up_since_probe: float = float("-inf")
    """When the last probe that found it answering ``/health`` was sent (``time.perf_counter``)."""
    probe: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None and not self.given_up


@dataclass
class Counters:
    requests: int = 0
    retries: int = 0
    transient: dict[str, int] = field(default_factory=dict)
    outages: int = 0
    outage_s: float = 0.0
    latencies_s: array = field(default_factory=lambda: array("d"))
    """Seconds from sending each answered request to having its whole answer."""


def _completion(answer: bytes) -> dict[str, Any] | None:
    """The chat completion in a 200's body; None when the body holds none."""
    try:
        data = loads(answer)
        data["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return data


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            error = error.get("message") or error.get("detail") or error
        elif "detail" in data:
            error = data["detail"]
        return str(error)[:500]
    return text.strip()[:500]


def _one_line(exc: BaseException) -> str:
    """The exception's type and message on one line (aiohttp's parser errors span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split()).removesuffix(":")


def _retry_after(headers: Any) -> float | None:
    try:
        return float(headers.get("Retry-After", ""))
    except ValueError:
        return None


class ChatClient:
    """POSTs ``/v1/chat/completions`` to the least-loaded live server, retrying transient errors."""

    def __init__(
        self,
        urls: list[str],
        *,
        concurrency: int,
        request_timeout_s: float,
        retry: Retry,
        patience_s: float = 600.0,
        api_key: str | None = None,
        log: Callable[[str], None] | None = None,
        poll_s: float = 0.5,
        locate: Callable[[], list[str]] | None = None,
    ) -> None:
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self._locate = locate
        """Where the servers answer now, in the order of ``urls``: a server down is looked for there
        (a service's replica the runner started again on another node)."""
        self.retry = retry
        self.patience_s = patience_s
        self.poll_s = poll_s
        self.counters = Counters()
        self._log = log or (lambda message: None)
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None
        self._turn = 0
        self._watchers: set[asyncio.Task] = set()
        self._changed = asyncio.Event()

    async def __aenter__(self) -> ChatClient:
        # One connection per request in flight per server; keep-alive reuses them.
        connector = aiohttp.TCPConnector(
            limit=self._concurrency * len(self.servers),
            limit_per_host=self._concurrency,
            ttl_dns_cache=None,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=self._timeout,
            raise_for_status=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = [*self._watchers, *(s.probe for s in self.servers if s.probe is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use ChatClient as an async context manager")
        return self._session

    # -- health ------------------------------------------------------------------------
    async def _health_problem(self, server: Server) -> str | None:
        """None when ``server`` answers ``/health`` with 200, else what went wrong.

        ``/v1/models`` stands in only for a server without ``/health`` (404): an SGLang
        server that is unwell answers 503 there while it still lists its model.
        """
        for path in ("/health", "/v1/models"):
            try:
                async with self.session.get(server.url + path, timeout=_PROBE_TIMEOUT) as response:
                    status = response.status
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return f"GET {path}: {_one_line(exc)}"
            if status == 200:
                return None
            if status in (401, 403):
                raise AuthError(f"{server.url}{path} answered HTTP {status}: {_AUTH_HINT}")
            if status != 404:
                return f"GET {path} answered HTTP {status}"
        return "GET /health and /v1/models answered HTTP 404"

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every server answers ``/health`` (or, without one, ``/v1/models``)."""
        await asyncio.gather(*(self._wait_one(s, timeout_s) for s in self.servers))

    async def _wait_one(self, server: Server, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (problem := await self._health_problem(server)) is not None:
            if time.monotonic() >= deadline:
                raise HealthTimeout(
                    f"server {server.url} was not healthy after {timeout_s:.0f}s ({problem}); "
                    "start it, check the URL, or raise --health-timeout"
                )
            await asyncio.sleep(self.poll_s)

    async def _up_after(self, server: Server, sent: float) -> bool:
        """Whether ``server`` answered ``/health`` to a probe sent after ``sent`` (``perf_counter``).

        One probe at a time per server, shared by every request that failed meanwhile: a storm
        of failures costs a probe per round trip, not one per request.
        """
        while server.up:
            if server.up_since_probe >= sent:
                return True
            if server.probe is None or server.probe.done():
                server.probe = asyncio.create_task(self._probe(server))
            # Shielded: a worker cancelled while it waits must not cancel the others' probe.
            await asyncio.shield(server.probe)
        return False

    async def _probe(self, server: Server) -> None:
        sent = time.perf_counter()
        problem = await self._health_problem(server)
        if problem is None:
            server.up_since_probe = max(server.up_since_probe, sent)
            return
        if server.up:
            server.down_since = time.monotonic()
            self.counters.outages += 1
            self._log(
                f"generate: {server.url} stopped answering ({server.last_error}; {problem}); requests "
                f"wait for it, without spending retries, up to {self.patience_s:.0f}s (--health-timeout)"
            )
            watcher = asyncio.create_task(self._watch(server))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, server: Server) -> None:
        """Poll a down server's ``/health`` until it is back or the patience runs out."""
        assert server.down_since is not None
        while True:
            await asyncio.sleep(self.poll_s)
            self._follow(server)
            sent = time.perf_counter()
            problem = await self._health_problem(server)
            now = time.monotonic()
            if problem is None:
                down_s = now - server.down_since
                self.counters.outage_s += down_s
                server.down_since, server.up_since_probe = None, sent
                self._log(f"generate: {server.url} answers again after {down_s:.0f}s")
                break
            server.last_error = problem
            if now - server.down_since >= self.patience_s:
                server.given_up = True
                self._log(f"generate: {server.url} gave no answer for {self.patience_s:.0f}s; given up")
                break
        # Wake every request waiting for a server: one is back, or one fewer can come back.
        self._changed.set()
        self._changed = asyncio.Event()

    def _follow(self, server: Server) -> None:
        """Point ``server`` at where it answers now, if it answers elsewhere."""
        if self._locate is None:
            return
        now = [url.rstrip("/") for url in self._locate()]
        if len(now) != len(self.servers):
            return
        moved = now[self.servers.index(server)]
        if moved != server.url:
            self._log(f"generate: {server.url} was started again at {moved}; asking it there")
            server.url = moved

    async def first_model(self) -> str:
        """The first model a server lists at ``/v1/models``."""
        problems: list[str] = []
        for server in self.servers:
            url = server.url + "/v1/models"
            try:
                async with self.session.get(url) as response:
                    status = response.status
                    body = await response.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                problems.append(f"{url}: {_one_line(exc)}")
                continue
            if status in (401, 403):
                raise AuthError(f"{url} answered HTTP {status}: {_AUTH_HINT}")
            if status != 200:
                problems.append(f"{url} answered HTTP {status}")
                continue
            try:
                return str(json.loads(body)["data"][0]["id"])
            except (ValueError, KeyError, IndexError, TypeError):
                problems.append(f"{url} answered no model list: {body[:120]!r}")
        raise PermanentError("no_model", f"no server lists a model ({'; '.join(problems)}): pass --model")

    # -- requests ----------------------------------------------------------------------
    def _pick(self) -> Server | None:
        servers = self.servers
        if len(servers) == 1:
            return servers[0] if servers[0].up else None
        live = [s for s in servers if s.up]
        if not live:
            return None
        # Least outstanding; ties broken round-robin so idle servers share the start.
        self._turn += 1
        n = len(live)
        return min((live[(self._turn + i) % n] for i in range(n)), key=lambda s: s.outstanding)

    async def _wait_for_server(self) -> Server:
        while (server := self._pick()) is None:
            if all(s.given_up for s in self.servers):
                raise ServersDead(self.dead_summary())
            await self._changed.wait()
        return server

    def dead_summary(self) -> str:
        return "; ".join(
            f"{s.url} gave no answer for {self.patience_s:.0f}s ({s.last_error})"
            for s in self.servers
            if s.given_up
        )

    async def chat(self, body: bytes) -> dict[str, Any]:
        """One chat completion (parsed JSON) for a JSON request ``body``, through transient errors."""
        attempt = 0
        while True:
            server = self._pick() or await self._wait_for_server()
            server.outstanding += 1
            self.counters.requests += 1
            retry_after = None
            started = time.perf_counter()
            try:
                async with self.session.post(server.url + CHAT_PATH, data=body) as response:
                    answer = await response.read()
                    status = response.status
                    if status != 200:
                        retry_after = _retry_after(response.headers)
                if status == 200:
                    data = _completion(answer)
                    if data is not None:
                        self.counters.latencies_s.append(time.perf_counter() - started)
                        return data
                    # A proxy's page, a body cut short, an engine's hiccup: not the request's fault.
                    kind = "bad_response"
                    server.last_error = f"HTTP 200 without a chat completion: {answer[:120]!r}"
                elif status in (401, 403):
                    raise AuthError(f"{server.url} answered HTTP {status}: {_AUTH_HINT}")
                elif status not in TRANSIENT_STATUS:
                    raise PermanentError(f"http_{status}", _error_message(answer))
                else:
                    kind = f"http_{status}"
                    server.last_error = f"HTTP {status}: {_error_message(answer)[:120]}"
            except aiohttp.ClientConnectorError as exc:
                kind = "connect"
                server.last_error = f"connection refused: {exc.os_error}"
            except (
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                aiohttp.ClientPayloadError,
            ) as exc:
                kind = "disconnected"
                server.last_error = f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                kind = "timeout"
                server.last_error = "request timed out"
            except aiohttp.ClientError as exc:
                # Any other client error (a garbled response, a connection closed mid-read) says
                # nothing against the request itself: retried like a disconnect.
                kind = "client_error"
                server.last_error = _one_line(exc)
            finally:
                server.outstanding -= 1
            self.counters.transient[kind] = self.counters.transient.get(kind, 0) + 1
            # A 429 is a live server asking for patience; any other failure asks whether it is up.
            if kind != "http_429" and not await self._up_after(server, started):
                continue  # down: not this request's fault, so no retry is spent on it
            if attempt >= self.retry.max_retries:
                raise RetriesExhausted(kind, f"no answer after {attempt + 1} attempts: {server.last_error}")
            self.counters.retries += 1
            await asyncio.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1
