"""``eyrie accept``'s settings: its options, with these names (``cli.py`` derives them from here),
checked as they are read. The held-out rows are the ones training held out, so their defaults are
training's (``steps/records.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.steps.accept.measure import Engine, Settings
from pipeline.steps.accept.sets import BENCHMARKS, HELDOUT
from pipeline.steps.options import Cli, Duration
from pipeline.steps.records import HELDOUT_FRACTION, MAX_LENGTH
from pipeline.steps.sglang import Parsers, Speculation


class AcceptConfig(BaseModel):
    """The measurement asked for; ``settings`` is what ``run_accept`` runs it with."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    draft: Path
    """The exported draft (the train step's draft/)."""
    target: str
    """The target: a model folder or a hub id."""
    data: Path | None = None
    """The tokenize step's shards: their held-out rows are the 'heldout' set."""
    bench: list[str] = []
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
        """A name is checked before any work (``--check`` included); a file's lines when it is read."""
        for name in bench:
            if name not in BENCHMARKS and name != HELDOUT and not name.endswith(".jsonl"):
                known = ", ".join([*BENCHMARKS, HELDOUT])
                raise ValueError(
                    f"{name!r} is not a set eyrie knows ({known}) nor a FILE.jsonl of conversations"
                )
        return bench

    @model_validator(mode="after")
    def _what_the_engine_runs(self) -> AcceptConfig:
        if self.data is None and (not self.bench or HELDOUT in self.bench):
            raise ValueError("--data: the held-out rows are the prompts when --bench names no other set")
        if self.engine == "sglang" and self.tp < 1:
            raise ValueError(f"--tp {self.tp}: SGLang spans at least one GPU")
        if self.engine == "chain" and self.topk != 1:
            raise ValueError(
                f"--engine chain drafts one chain: --topk 1 and --num-draft-tokens {self.num_steps + 1} "
                f"(--num-steps + 1), not --topk {self.topk} --num-draft-tokens {self.num_draft_tokens}"
            )
        return self

    def settings(self, *, trust_remote_code: bool, release_target: str | None) -> Settings:
        """What ``run_accept`` runs with: these settings, with the permissions the command grants."""
        return Settings(
            draft=self.draft,
            target=self.target,
            data=self.data,
            bench=self.bench or [HELDOUT],
            engine=self.engine,
            speculation=Speculation(self.draft, self.num_steps, self.topk, self.num_draft_tokens),
            heldout_fraction=self.heldout_fraction,
            max_length=self.max_length,
            prompts=self.prompts,
            max_new_tokens=self.max_new_tokens,
            concurrency=self.concurrency,
            tp=self.tp,
            trust_remote_code=trust_remote_code,
            release_target=release_target,
            startup_timeout_s=self.startup_timeout_s,
            request_timeout_s=self.request_timeout_s,
            parsers=Parsers(self.reasoning_parser, self.tool_call_parser),
        )
