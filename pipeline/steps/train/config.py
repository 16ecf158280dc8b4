"""``eyrie train``'s settings: the ``--config`` file's keys and, with the same names, its options.

Light on purpose (no torch): the command line reads every option's type, default and help here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.steps.records import HELDOUT_FRACTION, MAX_LENGTH
from pipeline.steps.train.placement import Placement
from pipeline.steps.train.precision import Precision


class SettingsError(Exception):
    """Wrong settings: one ``<where>: <field>: <message>`` line per problem."""


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    data: Path
    """The tokenize step's shards (a folder of parquet files)."""
    target: Path
    """The target: a Hugging Face model folder, or a hub id (read from the hub's cache)."""
    trust_remote_code: bool = False
    """Run the code a target ships (``auto_map`` in its config), as Kimi-K2 needs."""
    release_target: str | None = None
    """URL of an SGLang server whose GPU memory training takes meanwhile (``sglang.gpus_released``)."""
    out_dir: Path = Path(".")
    """Where the draft, eval.json and checkpoints go (.: the step's directory)."""
    draft_vocab_size: int = Field(32000, ge=1)
    """Draft vocabulary: the most frequent assistant tokens."""
    ttt_steps: int = Field(7, ge=1)
    """Training-time-test steps K."""
    layer_ids: list[int] | None = Field(None, min_length=3, max_length=3)
    """The target's three feature layers, e.g. 1,15,28 (default: 1, L/2-1, L-4)."""
    loss_decay: float = 0.8
    """Training-time-test step k's loss weighs decay^k."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = Field(0.015, ge=0, le=1)
    """Share of the steps the learning rate warms up over (then cosine)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's weight decay."""
    grad_clip: float = Field(0.5, gt=0)
    """Gradient norm clip."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training rows."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps (overrides epochs; 0: by epochs)."""
    batch_size: int = Field(1, ge=1)
    """Rows per process per step (with --batch-tokens: 1)."""
    batch_tokens: int | None = Field(None, ge=3)
    """Tokens per process per step, padding included: each step takes as many rows as fit, a row
    longer than this cut to it; the placement is planned for it (0: --batch-size rows)."""
    max_length: int = Field(MAX_LENGTH, ge=3)  # rows shorter than 3 tokens have nothing to train on
    """Rows are cut to this many tokens."""
    seed: int = 0
    """Seed of the data order and the draft's initial weights."""
    checkpoint_every: int = Field(100, ge=1)
    """Steps between checkpoints."""
    log_every: int = Field(10, ge=1)
    """Steps between progress lines."""
    heldout_fraction: float = Field(HELDOUT_FRACTION, ge=0, lt=1)
    """Share of the rows held out for evaluation (and for eyrie accept)."""
    loss_chunk: int = Field(512, ge=1)
    """Positions whose draft-vocabulary logits are computed at once (recomputed in backward)."""
    recompute_steps: bool = True
    """Run each TTT step's layer again in the backward instead of keeping its activations: measured,
    0.29x the memory a step takes for 0.85x its tokens/s (benchmarks/README.md, "Long rows")."""
    eval_prompts: int = Field(32, ge=0)
    """Held-out prompts decoded for eval.json."""
    eval_max_new_tokens: int = Field(64, ge=1)
    """Tokens decoded per evaluated prompt."""
    threads: int | None = Field(None, ge=1)
    """torch CPU threads (default: torch's)."""
    nproc: int = Field(1, ge=1)
    """Processes per node (torchrun)."""
    nnodes: int = Field(1, ge=1)
    """Nodes (torchrun)."""
    target_placement: Placement = "auto"
    """Where the target lives: auto, replicated, sharded or offline."""
    features_dir: Path | None = None
    """Where the offline placement writes the target's features (default: OUT/features)."""
    precision: Precision = "auto"
    """What training computes in: auto, fp32 or bf16 (the target held in bf16, autocast); auto is bf16
    on a GPU with bf16 arithmetic, fp32 elsewhere."""
    dequantize_target: bool = False
    """Hold a quantized target dequantized (its dense size) instead of packed as stored."""

    @field_validator("max_steps", mode="before")
    @classmethod
    def _zero_is_by_epochs(cls, value: object) -> object:
        return None if value == 0 else value

    @field_validator("batch_tokens", mode="before")
    @classmethod
    def _zero_is_by_rows(cls, value: object) -> object:
        return None if value in (0, "0") else value

    @model_validator(mode="after")
    def _one_batch_measure(self) -> TrainConfig:
        if self.batch_tokens is not None and self.batch_size != 1:
            raise ValueError("give --batch-size (rows) or --batch-tokens (a token budget), not both")
        return self

    @property
    def row_limit(self) -> int:
        """Rows are cut to this many tokens: --max-length, or the token budget where it is smaller."""
        return min(self.max_length, self.batch_tokens or self.max_length)
