"""The catalog: which dataset sources prep reads, and how each one's rows are shaped."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_CATALOG = Path(__file__).with_name("catalog.yaml")
DEFAULT_CATALOG_NAME = "default"  # how a command line names the shipped catalog

Format = Literal["messages", "sharegpt", "pairs", "tokenized"]

# The fields each adapter reads unless a source overrides them (``fields:``).
DEFAULT_FIELDS: dict[str, dict[str, str]] = {
    "messages": {"messages": "messages", "tools": "tools", "system": "system"},
    "sharegpt": {"messages": "conversations", "tools": "tools", "system": "system"},
    "pairs": {"prompt": "prompt", "response": "response", "system": "system"},
    "tokenized": {"input_ids": "input_ids", "loss_mask": "loss_mask"},
}
# Columns holding a dataset's own row id, looked for in this order (``fields: {id: COLUMN}`` names
# the one to use instead); a row with none is known by its index in the source.
ID_COLUMNS = ("id", "conversation_id", "conversation_hash", "prompt_id", "traj_id", "instance_id", "uuid")
ID_FIELD = "id"
# ShareGPT speakers as the datasets write them; a source can extend the map (``roles:``).
DEFAULT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}


class CatalogError(ValueError):
    """A catalog file that cannot be used; the message says where and how to fix it."""


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    data: str
    """A Hugging Face hub id, or a local .jsonl/.json/.parquet file or folder (relative to the catalog)."""
    format: Format
    config: str | None = None
    split: str = "train"
    sample: str | None = None
    """A local file in the source's schema, read instead of ``data`` with ``--offline``."""
    fields: dict[str, str] = {}
    roles: dict[str, str] = {}
    quota: int | None = Field(default=None, gt=0)
    """The most records taken from this source (after its own dedup and filters)."""
    native: bool = False
    """Rows are already the target model's outputs: they become conversations, not prompts."""
    prompt: Literal["last_turn", "first_turn"] = "last_turn"
    """A prompt source's prompt: the conversation up to its last user turn (the history its answer
    continues), or its opening question alone (the first user turn, after any system message)."""
    min_chars: int = 1
    max_chars: int | None = None

    @model_validator(mode="after")
    def _check(self) -> Source:
        known = {*DEFAULT_FIELDS[self.format], ID_FIELD}
        unknown = set(self.fields) - known
        if unknown:
            raise ValueError(
                f"fields {sorted(unknown)} mean nothing to the {self.format!r} adapter "
                f"(it reads {sorted(known)})"
            )
        bad_roles = {v for v in self.roles.values()} - {"system", "user", "assistant", "tool"}
        if bad_roles:
            raise ValueError(f"roles map to {sorted(bad_roles)}; use system, user, assistant, tool")
        return self

    def field(self, key: str) -> str:
        return self.fields.get(key, DEFAULT_FIELDS[self.format][key])

    def id_columns(self) -> tuple[str, ...]:
        """Where a row's own id is looked for: the column ``fields: {id: …}`` names, else ID_COLUMNS."""
        return (self.fields[ID_FIELD],) if ID_FIELD in self.fields else ID_COLUMNS

    def role_map(self) -> dict[str, str]:
        return {**DEFAULT_ROLES, **self.roles}

    def location(self, base: Path, offline: bool) -> str:
        """What to open: a local path (resolved against the catalog's folder) or a hub id."""
        chosen = self.sample if offline and self.sample else self.data
        local = base / chosen
        if local.exists() or chosen.startswith((".", "/")) or chosen.endswith(LOCAL_SUFFIXES):
            return str(local.resolve())
        if offline:
            raise CatalogError(
                f"source {self.name!r}: --offline needs a local file, but data is the hub id "
                f"{chosen!r} and no 'sample:' is given; add a sample file or drop --offline"
            )
        return chosen


LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[Source]
    seed: int = 0
    base: Path = Path(".")
    """Folder that relative ``data``/``sample`` paths start from (the catalog's own folder)."""

    def capped(self, quota: int) -> Catalog:
        """Every source limited to ``quota`` records (a lower quota of its own stays)."""
        sources = [s.model_copy(update={"quota": min(s.quota or quota, quota)}) for s in self.sources]
        return self.model_copy(update={"sources": sources})

    @model_validator(mode="after")
    def _unique(self) -> Catalog:
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique; repeated: {', '.join(dupes)}")
        if not self.sources:
            raise ValueError("the catalog lists no sources")
        return self


def load_catalog(path: Path | None = None) -> Catalog:
    """A catalog file; None or ``default``: the shipped one."""
    path = Path(DEFAULT_CATALOG if path is None or str(path) == DEFAULT_CATALOG_NAME else path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(f"catalog {path} does not exist; pass --catalog PATH") from None
    except yaml.YAMLError as exc:
        raise CatalogError(f"catalog {path} is not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise CatalogError(f"catalog {path} must be a mapping with a 'sources:' list")
    try:
        return Catalog(**raw, base=path.parent.resolve())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CatalogError(f"catalog {path}: {where}: {first['msg']}") from None
