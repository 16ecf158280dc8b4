"""Command-line options the steps share, and options derived from a step's settings model.

Each step's module owns its ``eyrie`` command (``pipeline/cli.py`` only adds it); what several
steps ask alike is declared here once. Every step's settings are a pydantic model (``eyrie
train``'s: the same names in its ``--config`` file), and its command takes its options from that
model with ``settings_options``, so that a setting's name, type, default, range and help are
stated once, in the model; ``validated`` builds the model from them, a wrong value said in one
line naming its option.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import annotated_types
import typer
from pydantic import BaseModel, BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo

from pipeline.contract.exits import EXIT_BAD_INPUT, say_error
from pipeline.contract.step import service_urls_env
from pipeline.memory.units import duration_text, parse_duration

TARGET_SERVICE = "target"
"""The service a pipeline declares its target server as: a step that uses it finds the replicas'
URLs in ``TARGET_URLS_ENV``, which ``eyrie generate`` asks and ``--release-target`` falls back to."""
TARGET_URLS_ENV = service_urls_env(TARGET_SERVICE)

# A permission, not a setting of what is computed: a pipeline grants it through the environment.
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        envvar="EYRIE_TRUST_REMOTE_CODE",
        help="Run the code the target ships (auto_map in its config; Kimi-K2 needs it).",
    ),
]


def server_url(option: str, url: str) -> str:
    """``url``, checked to be an http(s) URL, or a ValueError naming ``option``: one without a
    scheme would only fail once a server's whole health timeout has passed."""
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError(
            f"{option}: {url!r} is not a server URL; write it with its scheme, e.g. http://{url}"
        )
    return url


def _release_target(value: str) -> str:
    """``--release-target`` refused at once, in one line, when it is neither ``no`` nor one URL (the
    target service's, when not given: a step that uses it can release one replica, not several)."""
    if value.strip().lower() not in ("", "no", "none"):
        try:
            if "," in value:
                raise ValueError(
                    f"--release-target: {value!r} names several servers (the target service's replicas?); "
                    "a step takes the GPUs of one: give its URL, or declare the service with replicas: 1"
                )
            server_url("--release-target", value)
        except ValueError as exc:
            say_error(str(exc))
            raise typer.Exit(EXIT_BAD_INPUT) from None
    return value


ReleaseTarget = Annotated[
    str,
    typer.Option(
        metavar="URL|no",
        envvar=TARGET_URLS_ENV,
        help="SGLang server (URL) whose GPU memory this step takes while it runs, or 'no'; a step "
        "that uses the target service is given its URL.",
        callback=_release_target,
    ),
]
OutDir = Annotated[Path | None, typer.Option(help="Where outputs go (default: the step dir, else the cwd).")]

CHECK_ONLY = "eyrie.check_only"
"""Set in a command's context (``ctx.meta``) by ``eyrie run --check``: the step validates its options
as when it runs, then stops before it reads data or writes (see ``settings_options``). A command's
callback that honours it carries this name as an attribute, set true."""


def checking() -> bool:
    """Whether ``eyrie run --check`` invoked this command (:data:`CHECK_ONLY`)."""
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    return ctx is not None and bool(ctx.meta.get(CHECK_ONLY))


def stop_when_checking() -> None:
    """End the command here, its options found valid, when ``eyrie run --check`` invoked it."""
    if checking():
        raise typer.Exit(0)


@dataclasses.dataclass(frozen=True)
class Cli:
    """How a settings field is written on the command line where its name and type do not say it:
    its ``flags`` (``"--offline/--online"``; else ``--field-name``, a bool's ``--name/--no-name``),
    what ``--help`` calls its value (``metavar``), the environment variable that gives it
    (``envvar``), and ``written``: the option is text the model parses (a duration), and a default
    that is not text is shown as ``written`` writes it. Put in the field's ``Annotated``."""

    flags: str | None = None
    metavar: str | None = None
    envvar: str | None = None
    written: Callable[[Any], str] | None = None


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    Field(validate_default=True),
    Cli(metavar="DURATION", written=duration_text),
]
"""Seconds, written as a duration is typed (``30s``, ``10m``, ``1h30m``): so may its default be."""


def _cli(field: FieldInfo) -> Cli:
    """What the field's ``Cli`` markers say, a later one's word winning."""
    said: dict[str, Any] = {}
    for marker in field.metadata:
        if isinstance(marker, Cli):
            said.update({k: v for k, v in dataclasses.asdict(marker).items() if v is not None})
    return Cli(**said)


def _option_type(annotation: Any) -> type:
    """What the command line reads for a field: its type without ``None``; text for a choice
    (``Literal``: the model checks it) or a list (comma-separated)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) in (Literal, list):
        return str
    return annotation


def _is_list(field: FieldInfo) -> bool:
    annotation = field.annotation
    return list in (typing.get_origin(annotation), *map(typing.get_origin, typing.get_args(annotation)))


def _group(field: FieldInfo) -> type[BaseModel] | None:
    """The model of a field that groups settings (generate's ``sampling``): each of its fields is an
    option of its own."""
    kind = field.annotation
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _settings(model: type[BaseModel]) -> dict[str, tuple[str | None, FieldInfo, type[BaseModel]]]:
    """Every setting of ``model`` by its name: the name of the field grouping it (or None), its
    field, and the model the field is in."""
    found: dict[str, tuple[str | None, FieldInfo, type[BaseModel]]] = {}
    for name, field in model.model_fields.items():
        group = _group(field)
        if group is None:
            found[name] = (None, field, model)
        else:
            found.update((sub, (name, f, group)) for sub, f in group.model_fields.items())
    return found


def _converted(model: type[BaseModel], name: str) -> bool:
    """Whether a validator of ``model`` sees the field's value before its type and range do: a value
    out of the range may be one it takes (train's ``--max-steps 0``: by epochs)."""
    validators = model.__pydantic_decorators__.field_validators.values()
    return any(v.info.mode != "after" and {name, "*"} & set(v.info.fields) for v in validators)


def _flag(name: str, field: FieldInfo | None = None) -> str:
    """The option that gives the field ``name``: the first of its flags."""
    flags = _cli(field).flags if field is not None else None
    return flags.split("/")[0] if flags else "--" + name.replace("_", "-")


def _number(kind: type) -> Callable[[str], Any]:
    """Read a number as ``kind``; what is not one is handed on as it is, for the model to refuse in
    one line naming the option (typer's refusal is a usage box)."""

    def read(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            return text

    return read


def _bounds(field: FieldInfo, kind: type) -> dict[str, Any]:
    """The range ``--help`` shows. The model checks it: typer is not told to (its refusal would not
    be one line)."""
    bounds: dict[str, Any] = {}
    for limit in field.metadata:
        if isinstance(limit, annotated_types.Ge):
            bounds["min"] = limit.ge
        elif isinstance(limit, annotated_types.Gt) and kind is int:
            bounds["min"] = limit.gt + 1
        elif isinstance(limit, annotated_types.Le):
            bounds["max"] = limit.le
        elif isinstance(limit, annotated_types.Lt) and kind is int:
            bounds["max"] = limit.lt - 1
    return bounds


def _option(name: str, field: FieldInfo, model: type[BaseModel]) -> inspect.Parameter:
    cli = _cli(field)
    kind = str if cli.written else _option_type(field.annotation)
    default = ... if field.is_required() else field.get_default(call_default_factory=True)
    if cli.written and default not in (..., None) and not isinstance(default, str):
        default = cli.written(default)
    if _is_list(field) and default not in (..., None):
        default = ",".join(map(str, default))
    flag = _flag(name)
    flags = cli.flags or (f"{flag}/--no-{flag[2:]}" if kind is bool else flag)
    bounds = {} if _converted(model, name) else _bounds(field, kind)
    reading = {"parser": _number(kind), **bounds} if kind in (int, float) else {}
    metavar = cli.metavar or ("A,B,C" if _is_list(field) else None)
    info = typer.Option(flags, help=field.description, metavar=metavar, envvar=cli.envvar, **reading)
    optional = kind | None if default is None else kind
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[optional, info]
    )


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` was given (on the command line or through its variable), not
    left at its default. By the source's name: typer's own click and the installed one differ."""
    return ctx.get_parameter_source(name).name not in ("DEFAULT", "DEFAULT_MAP")


def settings_options(
    model: type[BaseModel], *, checks_itself: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a Typer command an option for every field of ``model`` it does not declare itself:
    ``--field-name``, the field's type and default (shown in ``--help``, with its range), its
    docstring as help; a field whose type is a model (a group of settings) gives an option for each
    of its fields. A field's ``Cli`` marker says what its name and type do not (flags, metavar,
    environment variable, a value written as text).

    The command declares ``**settings`` and receives there only the settings given on the command
    line (or through an option's environment variable), lists as their items, a group's under its
    field's name; every other value is left to the model, so a settings file can set what the
    command line does not. Fields the command declares itself (a shared option, a value it
    converts) come to it as declared. Numbers are not range-checked here: the model does it.

    Under ``eyrie run --check`` (:data:`CHECK_ONLY`) the command runs only if it ``checks_itself``
    (validates as it runs, then calls :func:`stop_when_checking`); any other is checked here: its
    model of the settings given, then it stops.
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        declared = inspect.signature(command, eval_str=True).parameters
        own = [p for p in declared.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        every = _settings(model)
        fields = {name: found for name, found in every.items() if name not in declared}
        # The command's other options first, then the model's fields in order, declared ones in place.
        order = [p for p in own if p.name not in every]
        order += [declared[n] if n in declared else _option(n, f, m) for n, (_, f, m) in every.items()]
        order = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in order]

        @functools.wraps(command)
        def with_settings(ctx: typer.Context, **values: Any) -> Any:
            settings: dict[str, Any] = {}
            for name, value in values.items():
                if name in fields and _given(ctx, name):
                    group, field, _ = fields[name]
                    into = settings.setdefault(group, {}) if group else settings
                    into[name] = value.split(",") if _is_list(field) else value
            if not checks_itself and checking():
                validated(model, **settings)
                raise typer.Exit(0)
            return command(**{p.name: values[p.name] for p in own}, **settings)

        context = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        with_settings.__signature__ = inspect.Signature([context, *order])  # type: ignore[attr-defined]
        setattr(with_settings, CHECK_ONLY, True)
        return with_settings

    return decorate


def settings_keywords(model: type[BaseModel]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Let a step's entry, which takes its settings whole (its keyword ``settings``, a ``model``), be
    called with them one by one instead: each field of ``model`` is a keyword of it, whose default is
    the model's (as the model holds it, its validators run), so that the defaults are stated once, in
    the model; ``settings=`` still hands a model whole, and the entry's other arguments stay its own.
    Every field of ``model`` has a default."""
    defaults = model()

    def decorate(run: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(run)
        declared = [p for p in signature.parameters.values() if p.name != "settings"]
        keyword = inspect.Parameter.KEYWORD_ONLY
        positional = [p for p in declared if p.kind is not keyword]
        whole = inspect.Parameter("settings", keyword, default=None, annotation=model | None)
        fields = [
            inspect.Parameter(name, keyword, default=getattr(defaults, name), annotation=field.annotation)
            for name, field in model.model_fields.items()
        ]

        @functools.wraps(run)
        def with_keywords(*args: Any, settings: BaseModel | None = None, **given: Any) -> Any:
            own = {name: given.pop(name) for name in list(given) if name not in model.model_fields}
            if settings is not None and given:
                raise TypeError(f"{run.__name__}: give the settings whole or one by one, not both")
            return run(*args, settings=model(**given) if settings is None else settings, **own)

        parameters = [*positional, whole, *fields, *(p for p in declared if p.kind is keyword)]
        with_keywords.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        return with_keywords

    return decorate


def _option_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str, int]:
    """The setting a value at ``loc`` (a pydantic error's) is, and how many of loc's parts name it
    (two in a group); ``""`` for the model as a whole."""
    if not loc:
        return "", 0
    field = model.model_fields.get(str(loc[0]))
    if field is not None and _group(field) is not None and len(loc) > 1:
        return str(loc[1]), 2
    return str(loc[0]), 1


def validation_lines(
    exc: ValidationError, model: type[BaseModel], where_of: Callable[[str], str] | None = None
) -> str:
    """One line per problem in ``exc``, blamed on where the value came from: ``where_of(setting)``
    (a settings file, say), by default the setting's option. The field is named unless the option
    says it; a validator's own message is said as it is (it names what it checks)."""
    every = _settings(model)
    lines = []
    for error in exc.errors():
        loc = error["loc"]
        name, parts = _option_at(model, loc)
        if error["type"] == "extra_forbidden":
            message = f"unknown setting (known: {', '.join(model.model_fields)})"
        elif error["type"] == "value_error":
            message = str(error.get("ctx", {}).get("error", error["msg"]))
        else:
            message = f"{error['msg']}, got {error['input']!r}"
        if not name:  # the model's check of several settings at once
            lines.append(message)
            continue
        flag = _flag(name, every[name][1] if name in every else None)
        where = where_of(name) if where_of else flag
        said = where == flag and len(loc) == parts
        lines.append(f"{where}: {message}" if said else f"{where}: {'.'.join(map(str, loc))}: {message}")
    return "\n".join(lines)


Settings = TypeVar("Settings", bound=BaseModel)


def validated(model: type[Settings], **values: Any) -> Settings:
    """``model`` of ``values``; a wrong one is one line naming its option (a line per problem) and
    the command's exit is 2, bad input."""
    try:
        return model(**values)
    except ValidationError as exc:
        say_error(validation_lines(exc, model))
        raise typer.Exit(EXIT_BAD_INPUT) from None
