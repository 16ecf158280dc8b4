"""The generation step's settings and their defaults: ``GenerateSettings`` are ``eyrie generate``'s
options, with these names (``cli.py`` derives them from here); ``GenerateConfig`` is what the driver
runs with, those settings and where the rows come from and go. ``settings_of`` is what rows are
recorded as made with (``generate.settings.json``), ``settings_diff`` how two such records differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pipeline.steps.generate.conversation import Mode
from pipeline.steps.options import Cli, Duration
from pipeline.steps.serving.http_retry import Retry


def _json_object(value: object) -> object:
    """A JSON object given as text (the command line's) read; none for empty text."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return None
    try:
        value = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object, e.g. '{\"enable_thinking\": true}'")
    return value


JsonObject = Annotated[dict[str, Any] | None, BeforeValidator(_json_object), Cli(written=json.dumps)]
"""A JSON object, written as its JSON text on the command line."""


class Sampling(BaseModel):
    """What each request asks the server for (recorded with the rows: a rerun must ask the same)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    temperature: float = Field(0.7, ge=0)
    """Sampling temperature (0: greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens with this much probability."""
    max_tokens: int = Field(2048, ge=1)
    """Tokens at most in each answer (see --drop-truncated)."""
    seed: int | None = None
    """Base seed; each row's seed derives from its id."""

    @property
    def repeatable(self) -> bool:
        """Asked again, a server gives the same answer: greedy, or a seed per row."""
        return self.temperature == 0 or self.seed is not None


class GenerateSettings(BaseModel):
    """``eyrie generate``'s settings (``sampling``'s fields are options of their own)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str | None = None
    """Model name (default: the server's first)."""
    mode: Mode = "last_turn"
    """last_turn or all_turns."""
    concurrency: int = Field(32, ge=1)
    """Requests in flight per server."""
    sampling: Sampling = Field(default_factory=Sampling)
    """What each request asks for."""
    chat_template_kwargs: JsonObject = None
    """JSON, e.g. '{"enable_thinking": true}'."""
    drop_truncated: bool = False
    """Put rows cut by max_tokens in errors.jsonl instead."""
    retry_errors: bool = False
    """Ask the ids in errors.jsonl again."""
    restart: Annotated[bool, Cli(envvar="EYRIE_GENERATE_RESTART")] = False
    """Move earlier rows aside (restarted/) and start over (in a pipeline: the variable, once)."""
    max_retries: int = Field(Retry.max_retries, ge=0)
    """Retries of a transient error while the server is up."""
    retry_base: float = Field(Retry.base_s, ge=0)
    """First backoff, seconds (doubles)."""
    max_error_rate: float = Field(0.5, ge=0, le=1)
    """Stop when this share of the last --error-window rows failed (1: never)."""
    error_window: int = Field(200, ge=1)
    """Rows the error rate is taken over."""
    request_timeout_s: Annotated[Duration, Cli(flags="--request-timeout")] = "10m"
    """Give up on one request after this long (then retried)."""
    health_timeout_s: Annotated[Duration, Cli(flags="--health-timeout")] = "10m"
    """Wait this long for a server to answer /health: at start and in an outage."""
    limit: int | None = None
    """Only the first N prompts."""

    @property
    def retry(self) -> Retry:
        """How a request that failed transiently is sent again."""
        return Retry(max_retries=self.max_retries, base_s=self.retry_base)


class GenerateConfig(GenerateSettings):
    """What the driver runs with: the settings, the prompts, the output folder and the servers."""

    prompts: Path
    out_dir: Path
    urls: list[str]
    service: str | None = None
    """The pipeline service ``urls`` are the replicas of: a replica that stops answering is looked
    for where the runner started it again."""
    api_key: str | None = Field(None, repr=False)
    """Sent as the bearer token; never printed or stored."""
    flush_rows: int = 512
    flush_interval_s: float = 1.0


# -- what rows are made with ---------------------------------------------------------------
def settings_of(config: GenerateConfig, model: str) -> dict[str, Any]:
    """What rows asked with ``config`` of ``model`` are made with: a rerun asking otherwise must not
    mix its answers with theirs."""
    return {
        "model": model,
        "mode": config.mode,
        "sampling": config.sampling.model_dump(),
        "chat_template_kwargs": config.chat_template_kwargs,
        "drop_truncated": config.drop_truncated,
    }


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The settings that differ, each ``key old -> new`` (nested keys joined by dots)."""
    before, after = _flatten(old), _flatten(new)
    return ", ".join(
        f"{key} {before.get(key)!r} -> {after.get(key)!r}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    )
