"""Requests to a server the steps share: which failures a later attempt may cure, and how long
to wait before it (``generate``, ``accept`` and SGLang's GPU hand-over retry alike)."""

from __future__ import annotations

import random
from dataclasses import dataclass

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
