"""The generation step's settings and their defaults: what ``eyrie generate``'s options show and
what the driver runs with (``cli.py`` reads each default here)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.steps.generate.conversation import Mode


@dataclass
class Sampling:
    """What each request asks the server for (recorded with the rows: a rerun must ask the same)."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 2048
    seed: int | None = None

    @property
    def repeatable(self) -> bool:
        """Asked again, a server gives the same answer: greedy, or a seed per row."""
        return self.temperature == 0 or self.seed is not None


# HTTP statuses a later attempt of the same request may not get.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


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
class GenerateConfig:
    prompts: Path
    out_dir: Path
    urls: list[str]
    model: str | None = None
    mode: Mode = "last_turn"
    concurrency: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    chat_template_kwargs: dict[str, Any] | None = None
    drop_truncated: bool = False
    retry_errors: bool = False
    restart: bool = False
    request_timeout_s: float = 600.0
    health_timeout_s: float = 600.0
    """How long to wait for a server to answer ``/health``: at the start, and whenever it stops."""
    retry: Retry = field(default_factory=Retry)
    max_error_rate: float = 0.5
    error_window: int = 200
    api_key: str | None = None
    flush_rows: int = 512
    flush_interval_s: float = 1.0
    limit: int | None = None
