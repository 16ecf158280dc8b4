"""``eyrie accept``'s settings: its options, with these names (``cli.py`` derives them from here),
checked as they are read; ``AcceptRun`` is what ``measure.run_accept`` runs with, these settings and
what the command grants. The held-out rows are the ones training held out, so their defaults are
training's (``steps/records.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.steps.accept.sets import HELDOUT, check_set_name
from pipeline.steps.options import Cli, Duration
from pipeline.steps.records import HELDOUT_FRACTION, MAX_LENGTH
from pipeline.steps.serving.http_retry import Retry
from pipeline.steps.serving.sglang import Parsers, Speculation

Engine = Literal["sglang", "chain"]


class AcceptConfig(BaseModel):
    """The measurement asked for; ``settings`` is what ``run_accept`` runs it with."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    draft: Path
    """The exported draft (the train step's draft/)."""
    target: str
    """The target: a model folder or a hub id."""
    data: Path | None = None
    """The tokenize step's shards: their held-out rows are the 'heldout' set."""
    bench: list[str] = Field([], validate_default=True)
    """Prompt sets, each measured on its own: mtbench, humaneval (eyrie's bench extra), heldout, or a
    FILE.jsonl of conversations ({messages|conversations: [{role, content}]}); none: heldout."""
    engine: Engine = "sglang"
    """'sglang' (serve target + draft on the GPUs) or 'chain' (CPU)."""
    num_steps: int = Field(3, ge=1)
    """Draft passes per target forward (SGLang's)."""
    topk: int = Field(1, ge=1)
    """Branches per draft pass (SGLang's eagle top-k)."""
    num_draft_tokens: int = Field(4, ge=1)
    """Tokens verified per target forward."""
    heldout_fraction: float = Field(HELDOUT_FRACTION, ge=0, lt=1)
    """The fraction training held out."""
    max_length: int = Field(MAX_LENGTH, ge=3)
    """Row length training used."""
    prompts: int = Field(64, ge=1)
    """Prompts measured per set (its first ones)."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens decoded per prompt."""
    concurrency: int = Field(16, ge=1)
    """Requests in flight (sglang)."""
    tp: int = 1
    """SGLang tensor parallelism: the GPUs it spans (sglang)."""
    startup_timeout_s: Annotated[Duration, Cli(flags="--startup-timeout")] = "60m"
    """Wait this long for each server."""
    request_timeout_s: Annotated[Duration, Cli(flags="--request-timeout")] = "10m"
    """Give up on one request after this long (sglang)."""
    reasoning_parser: str = ""
    """SGLang's --reasoning-parser, as the target is served (empty: none)."""
    tool_call_parser: str = ""
    """SGLang's --tool-call-parser, as the target is served (empty: none)."""

    @field_validator("bench")
    @classmethod
    def _known_sets(cls, bench: list[str]) -> list[str]:
        """A name is checked before any work (``--check`` included); a file's lines when it is read.
        None named: the held-out rows, so that the settings hold the sets that are measured."""
        for name in bench:
            check_set_name(name)
        return bench or [HELDOUT]

    @model_validator(mode="after")
    def _what_the_engine_runs(self) -> AcceptConfig:
        if self.data is None and HELDOUT in self.bench:
            raise ValueError("--data: the held-out rows are the prompts when --bench names no other set")
        if self.engine == "sglang" and self.tp < 1:
            raise ValueError(f"--tp {self.tp}: SGLang spans at least one GPU")
        if self.engine == "chain" and self.topk != 1:
            raise ValueError(
                f"--engine chain drafts one chain: --topk 1 and --num-draft-tokens {self.num_steps + 1} "
                f"(--num-steps + 1), not --topk {self.topk} --num-draft-tokens {self.num_draft_tokens}"
            )
        return self

    @property
    def speculation(self) -> Speculation:
        """The speculative decoding asked for: SGLang's --speculative-* flags."""
        return Speculation(self.draft, self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def parsers(self) -> Parsers:
        """Those of the server generate asked, so that accept's servers are started as the target is
        served (they split chat answers; the token ids ``/generate`` returns are the same without)."""
        return Parsers(self.reasoning_parser, self.tool_call_parser)

    def settings(self, *, trust_remote_code: bool, release_target: str | None) -> AcceptRun:
        """What ``run_accept`` runs with: these settings, with the permissions the command grants."""
        return AcceptRun(**dict(self), trust_remote_code=trust_remote_code, release_target=release_target)


class AcceptRun(AcceptConfig):
    """What ``run_accept`` runs with: the settings, and what the command grants beside them."""

    model_config = ConfigDict(frozen=True)

    trust_remote_code: bool = False
    """Run the code the target ships (the command's --trust-remote-code)."""
    release_target: str | None = None
    """URL of an SGLang server whose GPU memory the step takes meanwhile (``sglang.gpus_released``)."""
    retry: Retry = Field(default_factory=Retry)
    """Of each request to a server: a transient fault (refused, reset, timed out, 5xx) is sent again."""
