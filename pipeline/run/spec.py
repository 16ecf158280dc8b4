"""The pipeline file: steps declared, not coded into the orchestrator."""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from pipeline.contract.step import (
    PIPELINE_DIR_ENV,
    RUN_DIR_ENV,
    SERVICE_PORT_ENV,
    STATE_DIR,
    STEP_DIR_ENV,
    STEP_NAME_ENV,
)
from pipeline.memory import MIB, parse_duration, parse_size
from pipeline.run import EXECUTORS
from pipeline.run.executor import StepOptions, executor_class
from pipeline.run.layout import REPORT_NAME
from pipeline.run.ledger import LEDGER_FILES
from pipeline.run.verdict import MEMORY_VERDICTS, Verdict

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
# ${NAME} or ${NAME:-default} (the default when NAME is unset or empty), as in compose files.
VARIABLE_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# Set by the runner for each step, so left for it to expand: the run directory, the step's
# directory and name, the folder of the pipeline file; for a service's replica, its port.
RUNNER_VARIABLES = frozenset({RUN_DIR_ENV, STEP_DIR_ENV, STEP_NAME_ENV, PIPELINE_DIR_ENV, SERVICE_PORT_ENV})
MAX_REPLICAS = 64
MAX_FILE_VALUES = 100_000  # keys, lists and scalars a pipeline file may expand to (its aliases too)
# A step's or service's folder is named after it beside these: the name must not be one of them.
RUN_DIR_OWN_NAMES = frozenset({*LEDGER_FILES, REPORT_NAME, STATE_DIR})


def _size(value: Any) -> int:
    """A size as a pipeline file writes it: with its unit (a bare ``memory: 256`` is refused, not
    read as 256 bytes)."""
    bare = str(value).strip()
    if not isinstance(value, bool) and re.fullmatch(r"\d+(\.\d+)?", bare):
        raise ValueError(f"{bare}: a size needs a unit: write e.g. {bare}MiB or {bare}GiB")
    return parse_size(value)


Size = Annotated[int, BeforeValidator(_size)]
Duration = Annotated[float, BeforeValidator(parse_duration)]


def _argv(value: Any) -> Any:
    """YAML reads `[sleep, 5]` or `[true]` as numbers and booleans; in an argv they are words."""
    if not isinstance(value, list):
        return value
    return [
        str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, (int, float)) else v for v in value
    ]


Argv = Annotated[list[str], BeforeValidator(_argv)]
DEFAULT_RETRY_ON = [verdict for verdict in Verdict if verdict in MEMORY_VERDICTS]


class PipelineError(ValueError):
    """The pipeline file is wrong; the message names the file and the field."""


class _At(ValueError):
    """A problem the whole pipeline's check finds at ``loc`` (a step's needs, say), not at the top."""

    def __init__(self, loc: tuple[Any, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def _unknown(kind: str, names: list[str], known: list[str]) -> str:
    """``unknown step 'hgo'; did you mean 'hog'? (steps: hog, after-hog)``."""
    said = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        said.append(f"unknown {kind} {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    declared = f"{kind}s: {', '.join(known)}" if known else f"no {kind} is declared"
    return f"{', '.join(said)} ({declared})"


class _Declared(BaseModel):
    """A step or a service as its file declares it: where (set as the file is read)."""

    _index: int | None = PrivateAttr(None)
    _lines: dict[str, int] = PrivateAttr(default_factory=dict)
    """The line of each key it writes; ``""``: its own."""

    def at(self, pipeline_path: Path, key: str = "") -> str:
        """Where ``key`` of it is written: ``FILE:LINE: steps[0] (hog).memory``."""
        kind = "services" if isinstance(self, _Service) else "steps"
        field = f".{key}" if key else ""
        if self._index is None:  # made in code, not read from a file
            return f"{pipeline_path}: {kind} ({self.name}){field}"  # type: ignore[attr-defined]
        line = self._lines.get(key.split("[")[0], self._lines.get(""))
        return f"{pipeline_path}:{line}: {kind}[{self._index}] ({self.name}){field}"  # type: ignore[attr-defined]


class UnknownVariable(KeyError):
    pass


def substitute(text: str, lookup) -> str:
    """``text`` with each ``${NAME}`` / ``${NAME:-default}`` replaced by ``lookup(name, default)``.

    ``lookup`` returns the value, or None to leave the reference as written; it raises
    UnknownVariable for a name it cannot resolve.
    """

    def one(match: re.Match[str]) -> str:
        value = lookup(match.group(1), match.group(2))
        return match.group(0) if value is None else value

    return VARIABLE_RE.sub(one, text)


# Each executor's options, under its name: for the whole pipeline, and per step on top of that.
_EXECUTOR_FIELDS: dict[str, Any] = {name: (executor_class(name).Options | None, None) for name in EXECUTORS}


class _Step(_Declared):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_RE)
    command: Argv = Field(min_length=1)
    memory: Size
    needs: list[str] = []
    inputs: list[str] = []
    """Files (relative to the pipeline file) whose content the step's results depend on."""
    outputs: list[str] = []
    """Paths relative to the step's directory that the step must produce."""
    timeout: Duration | None = None
    retries: int = Field(0, ge=0, le=20)
    retry_on: list[Verdict] = DEFAULT_RETRY_ON
    """Verdicts after which a retry makes sense; failed/crashed only when named here."""
    memory_growth: float = Field(1.5, gt=1.0, le=10.0)
    """After an OOM kill the next limit is the recorded peak (or the limit) times this."""
    env: dict[str, str] = {}
    gpus: int = Field(0, ge=0)
    uses: list[str] = []
    """The services it needs running while it runs; their URLs come in ``EYRIE_SERVICE_<NAME>_URLS``."""

    @field_validator("memory")
    @classmethod
    def _positive(cls, value: int) -> int:
        return _at_least_4mib(value)

    @field_validator("outputs", "inputs")
    @classmethod
    def _relative(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if Path(path).is_absolute() or ".." in Path(path).parts:
                raise ValueError(f"{path!r} must be a relative path inside its directory")
        return paths

    @field_validator("retry_on")
    @classmethod
    def _retryable(cls, verdicts: list[Verdict]) -> list[Verdict]:
        if Verdict.SUCCEEDED in verdicts or Verdict.CANCELLED in verdicts:
            raise ValueError("succeeded and cancelled attempts are never retried")
        return verdicts


StepSpec = create_model("StepSpec", __base__=_Step, **_EXECUTOR_FIELDS)


def _at_least_4mib(value: int) -> int:
    if value < 4 * MIB:
        raise ValueError("memory limit must be at least 4MiB")
    return value


class _Service(_Declared):
    """A server the runner starts before the first step that uses it and stops after the last."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_RE)
    command: Argv = Field(min_length=1)
    """Its argv; ``${EYRIE_SERVICE_PORT}`` is the port the runner chose for the replica."""
    memory: Size
    gpus: int = Field(0, ge=0)
    env: dict[str, str] = {}
    health: str = Field("/health", pattern=r"^/")
    """The HTTP path that answers 200 once a replica is ready."""
    startup_timeout: Duration = 600.0
    """How long a replica may take to answer ``health`` before it is stopped and counted failed."""
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    retries: int = Field(2, ge=0, le=20)
    """How many times a replica that ended while in use (or never got ready) is started again."""
    url: str = ""
    """An external server's URL(s), comma-separated: when set, nothing is started and the steps that
    use the service get these (``url: ${EYRIE_TARGET_URL:-}`` lets a setting point at one)."""

    @field_validator("url")
    @classmethod
    def _urls(cls, value: str) -> str:
        for url in filter(None, value.split(",")):
            if not re.match(r"^https?://[^/\s]+", url.strip()):
                raise ValueError(f"{url!r} is not a server URL; write it with its scheme, e.g. http://{url}")
        return value

    @property
    def external(self) -> list[str]:
        """The external server's URLs; [] when the runner starts the service."""
        return [url.strip().rstrip("/") for url in self.url.split(",") if url.strip()]

    @field_validator("memory")
    @classmethod
    def _positive(cls, value: int) -> int:
        return _at_least_4mib(value)


ServiceSpec = create_model("ServiceSpec", __base__=_Service, **_EXECUTOR_FIELDS)


class _Pipeline(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "pipeline"
    budget: Size | None = None
    """Cap on the memory all running steps may hold together (default: what the host really has)."""
    steps: list[StepSpec] = Field(min_length=1)
    services: list[ServiceSpec] = []

    @model_validator(mode="after")
    def _graph(self) -> PipelineSpec:
        names = [s.name for s in self.steps]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"step names must be unique; repeated: {', '.join(dupes)}")
        services = [s.name for s in self.services]
        dupes = sorted({n for n in services if services.count(n) > 1})
        if dupes:
            raise ValueError(f"service names must be unique; repeated: {', '.join(dupes)}")
        if both := sorted(set(names) & set(services)):
            raise ValueError(f"{', '.join(both)}: the name of both a step and a service; rename one")
        if taken := sorted(set(names + services) & RUN_DIR_OWN_NAMES):
            raise ValueError(
                f"{', '.join(taken)}: a name eyrie keeps for its own files in the run directory "
                f"({', '.join(sorted(RUN_DIR_OWN_NAMES))}), where a step's folder is made; rename it"
            )
        for i, step in enumerate(self.steps):
            if step.name in step.needs:
                raise _At(("steps", i, "needs"), f"step {step.name!r} needs itself")
            if unknown := [n for n in step.needs if n not in names]:
                raise _At(("steps", i, "needs"), _unknown("step", unknown, names))
            if unknown := [n for n in step.uses if n not in services]:
                raise _At(("steps", i, "uses"), _unknown("service", unknown, services))
        self.order()  # raises on a cycle
        return self

    def service(self, name: str) -> ServiceSpec:
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(name)

    def users(self, service: str) -> list[str]:
        """The steps that use ``service``."""
        return [s.name for s in self.steps if service in s.uses]

    def step(self, name: str) -> StepSpec:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(name)

    def executor_options(self, executor: str, step: str | None = None) -> StepOptions | None:
        """``executor``'s options for ``step`` or service (the pipeline's, with its own on top), or
        the pipeline's alone; None for an executor that is not registered, such as a test's."""
        if executor not in EXECUTORS:
            return None
        options = executor_class(executor).Options
        own = None
        if step is not None:
            own = self.service(step) if step in {s.name for s in self.services} else self.step(step)
        given = [getattr(self, executor), getattr(own, executor) if own else None]
        merged: dict[str, Any] = {}
        for block in given:
            if block is not None:
                merged.update(block.model_dump(exclude_unset=True))
        return options.model_validate(merged)

    def order(self) -> list[StepSpec]:
        """Steps in dependency order (file order among independent ones)."""
        done: list[str] = []
        pending = list(self.steps)
        while pending:
            ready = [s for s in pending if all(n in done for n in s.needs)]
            if not ready:
                cycle = ", ".join(s.name for s in pending)
                raise ValueError(f"the needs of steps {cycle} form a cycle")
            for step in ready:
                done.append(step.name)
                pending.remove(step)
        return [self.step(n) for n in done]

    def upstream(self, name: str) -> list[str]:
        """Every step that ``name`` needs, directly or not."""
        out: list[str] = []
        frontier = [name]
        while frontier:
            for need in self.step(frontier.pop()).needs:
                if need not in out:
                    out.append(need)
                    frontier.append(need)
        return out

    def dependents(self, name: str) -> list[str]:
        """Every step that needs ``name``, directly or not."""
        out: list[str] = []
        frontier = [name]
        while frontier:
            current = frontier.pop()
            for step in self.steps:
                if current in step.needs and step.name not in out:
                    out.append(step.name)
                    frontier.append(step.name)
        return out


PipelineSpec = create_model("PipelineSpec", __base__=_Pipeline, **_EXECUTOR_FIELDS)


def _location(loc: tuple[Any, ...], raw: Any) -> str:
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(item, int):
            name = node[item].get("name") if isinstance(node, list) and isinstance(node[item], dict) else None
            parts.append(f"[{item}]" + (f" ({name})" if name else ""))
        else:
            parts.append(("." if parts else "") + str(item))
        try:
            node = node[item]
        except (KeyError, IndexError, TypeError):
            node = None
    return "".join(parts) or "(top level)"


def _value_lines(text: str) -> dict[tuple[Any, ...], int]:
    """The line each key and list item of the file is written on, by its path (keys and indexes); what
    an alias (``*name``) repeats is counted once, where it is first written."""
    lines: dict[tuple[Any, ...], int] = {}
    seen: set[int] = set()

    def walk(node: yaml.Node, where: tuple[Any, ...]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    lines[(*where, key.value)] = key.start_mark.line + 1
                    walk(value, (*where, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*where, i)] = item.start_mark.line + 1
                walk(item, (*where, i))

    walk(yaml.compose(text, Loader=yaml.SafeLoader), ())
    return lines


def _where(path: Path, loc: tuple[Any, ...], raw: Any, lines: dict[tuple[Any, ...], int]) -> str:
    """``FILE:LINE: steps[0] (hog).memory``: the line of ``loc``, or of the nearest block holding it."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return f"{path}:{lines[loc[:end]]}: {_location(loc, raw)}"
    return f"{path}: {_location(loc, raw)}"


def _yaml_problem(path: Path, text: str, exc: yaml.YAMLError) -> str:
    """What the YAML parser could not read, at its line and column, the line shown with a caret under
    the column; an indentation that breaks a block said as such (PyYAML's own words name tokens the
    file does not hold: "expected <block end>, but found '?'")."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return f"{path}: invalid YAML: {problem}"
    opened = getattr(exc, "context_mark", None)
    if problem.startswith("expected <block end>") and opened is not None:
        problem = (
            f"this line, indented to column {mark.column + 1}, does not continue the block begun at line "
            f"{opened.line + 1}, column {opened.column + 1}: indent it as the keys or items it belongs with"
        )
    shown = text.splitlines()[mark.line] if mark.line < len(text.splitlines()) else ""
    caret = " " * mark.column + "^"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {problem}\n    {shown}\n    {caret}"


def _expand_settings(
    raw: dict, path: Path, environ: Mapping[str, str], lines: dict[tuple[Any, ...], int]
) -> dict:
    """Every ``${NAME}`` / ``${NAME:-default}`` in the file's values, from ``environ``.

    Settings come from the environment before anything is validated, so a limit, an image
    or a GPU count can be one. The runner's own variables, and names a step or service sets in
    its ``env:``, are left for the runner to expand when the step starts.
    """

    values = 0

    def walk(node: Any, where: tuple, step_env: frozenset[str]) -> Any:
        nonlocal values
        values += 1
        if values > MAX_FILE_VALUES:  # an alias bomb would expand for minutes: refused at the bound
            raise PipelineError(
                f"{path}: more than {MAX_FILE_VALUES:,} values once its YAML aliases (*name) are "
                "expanded; a pipeline file holds far fewer: write the repeated part out, or alias less"
            )
        if isinstance(node, dict):
            if len(where) == 2 and where[0] in ("steps", "services") and isinstance(node.get("env"), dict):
                step_env = frozenset(node["env"])
            return {key: walk(value, (*where, key), step_env) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value, (*where, i), step_env) for i, value in enumerate(node)]
        if not isinstance(node, str):
            return node

        def lookup(name: str, default: str | None) -> str | None:
            if name in RUNNER_VARIABLES or name in step_env:
                return None
            if environ.get(name):
                return environ[name]
            if default is not None:
                return default
            if name in environ:  # set but empty, and no default
                return ""
            raise UnknownVariable(name)

        try:
            return substitute(node, lookup)
        except UnknownVariable as exc:
            raise PipelineError(
                f"{_where(path, where, raw, lines)}: unknown variable ${{{exc.args[0]}}}: not set in the "
                f"environment; set it, or give a default: ${{{exc.args[0]}:-VALUE}}"
            ) from None

    return walk(raw, (), frozenset())


def load_pipeline(path: str | Path, environ: Mapping[str, str] | None = None) -> PipelineSpec:
    """Read and validate a pipeline file; a PipelineError holds one line per problem, naming the
    file and the key.

    ``${NAME}`` and ``${NAME:-default}`` in its values are settings from ``environ`` (default:
    this process's environment).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
    except FileNotFoundError:
        raise PipelineError(f"{path}: no such pipeline file") from None
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read pipeline file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise PipelineError(
            f"{path}: cannot read pipeline file: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at "
            f"offset {exc.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise PipelineError(_yaml_problem(path, text, exc)) from None
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: expected a mapping with a 'steps' list at the top level")
    lines = _value_lines(text)
    raw = _expand_settings(raw, path, os.environ if environ is None else environ, lines)
    try:
        spec = PipelineSpec.model_validate(raw)
    except ValidationError as exc:
        raise PipelineError("\n".join(_problems(exc, raw, path, lines))) from None
    for kind in ("steps", "services"):
        for i, item in enumerate(getattr(spec, kind)):
            item._index = i
            item._lines = {
                key[2]: line for key, line in lines.items() if len(key) == 3 and key[:2] == (kind, i)
            }
            item._lines[""] = lines.get((kind, i), 0)
    return spec


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds, alone, in a list or beside ``None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        if (model := _model_in(argument)) is not None:
            return model
    return None


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the block at ``loc`` (the top level, a step, an executor's block) may hold."""
    model: type[BaseModel] | None = PipelineSpec
    for item in loc:
        if isinstance(item, str) and model is not None:
            field = model.model_fields.get(item)
            model = _model_in(field.annotation) if field else None
    return list(model.model_fields) if model else []


def _problems(exc: ValidationError, raw: dict, path: Path, lines: dict[tuple[Any, ...], int]) -> list[str]:
    """One line per problem, naming the file and the key; an unknown key with the valid one it is
    nearest (the misspelled required key then is not said missing too)."""
    suggested: set[tuple[Any, ...]] = set()
    unknown: dict[tuple[Any, ...], str] = {}
    for error in exc.errors():
        if error["type"] == "extra_forbidden":
            loc, known = error["loc"], _keys_at(error["loc"][:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            if close:
                suggested.add((*loc[:-1], close[0]))
                unknown[loc] = f"unknown key; did you mean {close[0]!r}?"
            else:
                unknown[loc] = f"unknown key (known: {', '.join(known)})"
    said = []
    for error in exc.errors():
        loc = error["loc"]
        if error["type"] == "missing" and loc in suggested:
            continue
        message = unknown.get(loc) or re.sub(r"^Value error, ", "", error["msg"])
        if error["type"] == "missing":
            message = "required key missing"
        if isinstance(at := error.get("ctx", {}).get("error"), _At):
            loc, message = at.loc, str(at)
        said.append(f"{_where(path, loc, raw, lines)}: {message}")
    return said
