"""``eyrie serve``: the target as a pipeline's service runs it, SGLang on the GPUs or ``transformers
serve`` on a CPU, on the port the runner chose for the replica (``$EYRIE_SERVICE_PORT``).

The command replaces itself with the server (exec): the server is the replica's own process, so
its memory, an OOM kill and its exit status are the replica's evidence, and the runner's stop
reaches it directly.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, ConfigDict, Field

from pipeline.contract.exits import EXIT_BAD_INPUT, say_error
from pipeline.contract.step import SERVICE_PORT_ENV
from pipeline.steps.options import TrustRemoteCode, settings_options, stop_when_checking, validated
from pipeline.steps.serving.sglang import Parsers, server_argv
from pipeline.steps.serving.step_server import ServeError, transformers_argv, transformers_env


class ServeConfig(BaseModel):
    """How ``eyrie serve`` serves the target: its options, with these names."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    engine: Literal["sglang", "transformers"] = "sglang"
    """sglang (the GPUs) or transformers (a CPU; the target a model folder)."""
    host: str = "0.0.0.0"  # noqa: S104 - a service is reached from its users' containers and nodes
    """The address to listen on (all of them: users in other containers and on other nodes)."""
    tp: int = Field(1, ge=0)
    """SGLang's tensor parallelism: the GPUs it spans (transformers on a CPU spans none: 0)."""
    reasoning_parser: str = ""
    """SGLang's --reasoning-parser (empty: none)."""
    tool_call_parser: str = ""
    """SGLang's --tool-call-parser (empty: none)."""
    memory_saver: bool = False
    """SGLang can give its GPU memory to a step meanwhile (a step's --release-target), keeping a copy
    of its weights in host memory (the target's size, inside the service's memory)."""
    sglang_args: str = ""
    """SGLang's own further flags, one line split at spaces (GLM-5-NVFP4: --quantization
    modelopt_fp4 --kv-cache-dtype bf16); empty: none. Flags the options above set are refused."""


def server_command(
    model: str, port: int, config: ServeConfig, trust_remote_code: bool
) -> tuple[list[str], dict]:
    """The server's argv and environment; a ValueError for a target the engine cannot serve."""
    if config.engine == "transformers":
        if config.sglang_args.strip():
            raise ValueError("--sglang-args: the transformers engine takes none of SGLang's flags")
        model_dir = Path(model).resolve()
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model}: not a model folder (no config.json); transformers serves a folder")
        # Requests in flight decode together (paged attention) rather than one after another.
        try:
            argv = transformers_argv(model_dir, host=config.host, port=port, continuous_batching=True)
        except ServeError as exc:
            raise ValueError(str(exc)) from None
        return argv, transformers_env()
    if config.tp < 1:
        raise ValueError(
            f"--tp {config.tp}: SGLang spans at least one GPU (--engine transformers serves on a CPU)"
        )
    parsers = Parsers(config.reasoning_parser, config.tool_call_parser)
    argv = server_argv(
        model, port=port, tp=config.tp, host=config.host, trust_remote_code=trust_remote_code, parsers=parsers
    )
    env = dict(os.environ)
    if config.memory_saver:
        argv += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
        # GET /health without a forward pass: while a step holds the GPUs, one would find the
        # weights unmapped and bring the server down.
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
    return argv + extra_flags(config.sglang_args, argv), env


def extra_flags(line: str, argv: list[str]) -> list[str]:
    """``--sglang-args``: ``line`` split at spaces (as compose's sglang service splits
    ``EYRIE_SGLANG_ARGS``), refused when it repeats a flag of ``argv``: SGLang would take the
    later one without a word, and the option that set it would no longer say what runs."""
    extra = line.split()
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    repeated = sorted(given & {arg for arg in argv if arg.startswith("--")})
    if repeated:
        raise ValueError(
            f"--sglang-args repeats {', '.join(repeated)}, which eyrie serve sets from its own options "
            "(--tp, --host, --port, the parsers, --memory-saver, --trust-remote-code): set it there"
        )
    return extra


@settings_options(ServeConfig, checks_itself=True)
def serve(
    model: Annotated[str, typer.Argument(help="The target: a model folder, or a hub id (sglang).")],
    port: Annotated[
        int, typer.Option(min=1, max=65535, envvar=SERVICE_PORT_ENV, help="The port to listen on.")
    ],
    trust_remote_code: TrustRemoteCode = False,
    **settings: Any,
) -> None:
    """Serve the target on PORT until stopped: the command a pipeline's target service runs."""
    config = validated(ServeConfig, **settings)
    try:
        argv, env = server_command(model, port, config, trust_remote_code)
    except ValueError as exc:
        say_error(str(exc))
        raise typer.Exit(EXIT_BAD_INPUT) from None
    stop_when_checking()
    print(f"eyrie serve: {shlex.join(argv)}", flush=True)
    os.execvpe(argv[0], argv, env)
