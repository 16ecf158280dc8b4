"""Command-line options the steps share, and options derived from a step's settings model.

Each step's module owns its ``eyrie`` command (``pipeline/cli.py`` only adds it); what several
steps ask alike is declared here once. A step whose settings are a pydantic model (``eyrie
train``: the same names in its ``--config`` file) takes its options from that model with
``settings_options``, so that a setting's name, type, default and help are stated once, in the
model.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pipeline.memory.units import parse_duration
from pipeline.run.step_contract import EXIT_BAD_INPUT, say_error

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


def duration_option(option: str, text: str) -> float:
    """Seconds of the duration ``text`` given as ``option``, or a ValueError naming the option."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _release_target(value: str) -> str:
    """``--release-target`` refused at once, in one line, when it is neither ``no`` nor a URL."""
    if value.strip().lower() not in ("", "no", "none"):
        try:
            server_url("--release-target", value)
        except ValueError as exc:
            say_error(str(exc))
            raise typer.Exit(EXIT_BAD_INPUT) from None
    return value


ReleaseTarget = Annotated[
    str,
    typer.Option(
        metavar="URL|no",
        help="SGLang server (URL) whose GPU memory this step takes while it runs, or 'no'.",
        callback=_release_target,
    ),
]
OutDir = Annotated[
    Path | None, typer.Option(help="Where outputs go (default: the step dir, else the cwd).")
]


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


def _option(name: str, field: FieldInfo) -> inspect.Parameter:
    flag = "--" + name.replace("_", "-")
    kind = _option_type(field.annotation)
    if kind is bool:
        info = typer.Option(flag, help=field.description)  # a flag: given, or left to the model
    else:
        info = typer.Option(flag, help=field.description, metavar="A,B,C" if _is_list(field) else None)
    default = ... if field.is_required() else field.get_default(call_default_factory=True)
    if _is_list(field) and default is not ...:
        default = None if default is None else ",".join(map(str, default))
    optional = kind | None if default is None else kind
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[optional, info])  # fmt: skip


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` was given (on the command line or through its variable), not
    left at its default. By the source's name: typer's own click and the installed one differ."""
    return ctx.get_parameter_source(name).name not in ("DEFAULT", "DEFAULT_MAP")


def settings_options(model: type[BaseModel]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a Typer command an option for every field of ``model`` it does not declare itself:
    ``--field-name``, the field's type and default (shown in ``--help``), its docstring as help.

    The command declares ``**settings`` and receives there only the settings given on the command
    line (or through an option's environment variable), lists as their items; every other value is
    left to the model, so a settings file can set what the command line does not. Fields the
    command declares itself (a shared option, a value it converts) come to it as declared.
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        declared = inspect.signature(command, eval_str=True).parameters
        own = [p for p in declared.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fields = {name: f for name, f in model.model_fields.items() if name not in declared}
        # The command's other options first, then the model's fields in order, declared ones in place.
        order = [p for p in own if p.name not in model.model_fields]
        order += [declared[n] if n in declared else _option(n, f) for n, f in model.model_fields.items()]
        order = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in order]

        @functools.wraps(command)
        def with_settings(ctx: typer.Context, **values: Any) -> Any:
            settings = {
                name: value.split(",") if _is_list(fields[name]) else value
                for name, value in values.items()
                if name in fields and _given(ctx, name)
            }
            return command(**{p.name: values[p.name] for p in own}, **settings)

        context = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        with_settings.__signature__ = inspect.Signature([context, *order])  # type: ignore[attr-defined]
        return with_settings

    return decorate
