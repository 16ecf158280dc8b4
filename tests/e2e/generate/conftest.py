"""Real HTTP for the generation tests: the fake OpenAI server (faults on demand) as a subprocess."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from generate_helpers import FakeServer


@pytest.fixture
def fake_server() -> Iterator:
    started: list[FakeServer] = []

    def start(*args: str, port: int = 0) -> FakeServer:
        server = FakeServer(*args, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()
