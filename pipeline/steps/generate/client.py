"""Chat requests to one or more OpenAI-compatible servers (SGLang, sglang-router, transformers serve).

aiohttp, not httpx: against a server that answers at once, httpx's AsyncClient spent
~2.8 ms of CPU per request on the 2-core test machine and aiohttp ~0.2 ms
(benchmarks/README.md); it is also what ``sglang.bench_serving`` uses.

Each request goes to the server with the fewest requests outstanding. Transient
failures (connection refused or reset, timeouts, 429, 5xx, any other HTTP client
error such as a garbled response) are retried with exponential backoff and full
jitter; a 4xx other than 429 is permanent and carries the server's message. A
server that still refuses connections after every retry is marked dead; when every
server is dead the run stops (``ServersDead``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class PermanentError(Exception):
    """The server rejected this request; retrying the same request will not help."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class ServersDead(Exception):
    """No server answers any more; the run must stop."""


class HealthTimeout(Exception):
    pass


class AuthError(Exception):
    """The server refused the credentials: no row can succeed, so the run stops."""


_AUTH_HINT = "give the API key with --api-key-env or --api-key-file"


@dataclass
class Server:
    url: str
    outstanding: int = 0
    dead: bool = False
    last_error: str = ""


@dataclass
class Retry:
    max_retries: int = 6
    base_s: float = 0.5
    cap_s: float = 20.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        # Full jitter (AWS architecture blog): spreads retries of many workers apart.
        backoff = random.uniform(0, min(self.cap_s, self.base_s * 2**attempt))
        return max(backoff, retry_after or 0.0)


@dataclass
class Counters:
    requests: int = 0
    retries: int = 0
    transient: dict[str, int] = field(default_factory=dict)


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
        api_key: str | None = None,
    ) -> None:
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.retry = retry
        self.counters = Counters()
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None
        self._turn = 0

    async def __aenter__(self) -> ChatClient:
        # One connection per request in flight per server; keep-alive reuses them.
        connector = aiohttp.TCPConnector(
            limit=self._concurrency * len(self.servers), limit_per_host=self._concurrency,
            ttl_dns_cache=None, enable_cleanup_closed=True,
        )  # fmt: skip
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self._headers, timeout=self._timeout,
            json_serialize=json.dumps, raise_for_status=False,
        )  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use ChatClient as an async context manager")
        return self._session

    # -- health ------------------------------------------------------------------------
    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Wait until every server answers ``/health`` (SGLang, transformers serve) or ``/v1/models``."""
        await asyncio.gather(*(self._wait_one(s, timeout_s, poll_s) for s in self.servers))

    async def _wait_one(self, server: Server, timeout_s: float, poll_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            for path in ("/health", "/v1/models"):
                try:
                    async with self.session.get(
                        server.url + path, timeout=aiohttp.ClientTimeout(total=10)
                    ) as response:
                        if response.status == 200:
                            return
                        last = f"GET {path} answered HTTP {response.status}"
                        if response.status in (401, 403):
                            raise AuthError(
                                f"{server.url}{path} answered HTTP {response.status}: {_AUTH_HINT}"
                            )
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    last = f"GET {path}: {type(exc).__name__} {exc}".strip()
            if time.monotonic() >= deadline:
                raise HealthTimeout(
                    f"server {server.url} was not healthy after {timeout_s:.0f}s ({last}); "
                    "start it, check the URL, or raise --health-timeout"
                )
            await asyncio.sleep(poll_s)

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
    def _pick(self) -> Server:
        live = [s for s in self.servers if not s.dead]
        if not live:
            raise ServersDead(self.dead_summary())
        if len(live) == 1:
            return live[0]
        # Least outstanding; ties broken round-robin so idle servers share the start.
        self._turn += 1
        n = len(live)
        return min((live[(self._turn + i) % n] for i in range(n)), key=lambda s: s.outstanding)

    def dead_summary(self) -> str:
        return "; ".join(f"{s.url} ({s.last_error})" for s in self.servers if s.dead)

    async def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One chat completion (parsed JSON), retried through transient errors."""
        attempt = 0
        refused_everywhere = 0
        while True:
            server = self._pick()
            server.outstanding += 1
            self.counters.requests += 1
            retry_after = None
            try:
                async with self.session.post(server.url + "/v1/chat/completions", json=payload) as response:
                    body = await response.read()
                    status = response.status
                    retry_after = _retry_after(response.headers)
                if status == 200:
                    try:
                        data = json.loads(body)
                        data["choices"][0]["message"]
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise PermanentError(
                            "bad_response", f"HTTP 200 without a chat completion: {body[:200]!r}"
                        ) from None
                    return data
                if status in (401, 403):
                    raise AuthError(f"{server.url} answered HTTP {status}: {_AUTH_HINT}")
                if status not in TRANSIENT_STATUS:
                    raise PermanentError(f"http_{status}", _error_message(body))
                kind = f"http_{status}"
                server.last_error = f"HTTP {status}: {_error_message(body)[:120]}"
            except aiohttp.ClientConnectorError as exc:
                # Nothing listens: the server is gone (or not yet back) at this address.
                kind = "connect"
                server.last_error = f"connection refused: {exc.os_error}"
                refused_everywhere += 1
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError) as exc:  # fmt: skip
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
            if attempt >= self.retry.max_retries:
                if kind == "connect" or refused_everywhere > self.retry.max_retries // 2:
                    server.dead = True
                    if all(s.dead for s in self.servers):
                        raise ServersDead(self.dead_summary())
                    attempt = 0  # another server takes this request from the start
                    continue
                raise PermanentError(kind, f"still failing after {attempt + 1} attempts: {server.last_error}")
            self.counters.retries += 1
            await asyncio.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1
