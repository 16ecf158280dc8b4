"""``eyrie generate``: its options (from ``GenerateSettings``, ``config.py``), the servers to ask,
the API key from env or file, a local server."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.contract.exits import EXIT_BAD_INPUT, say_error
from pipeline.contract.step import service_urls, step_dir_from_env
from pipeline.steps.generate.config import GenerateConfig, GenerateSettings
from pipeline.steps.options import (
    TARGET_SERVICE,
    TARGET_URLS_ENV,
    OutDir,
    server_url,
    settings_options,
    stop_when_checking,
    validated,
)

TARGET_URL_ENV = "EYRIE_TARGET_URL"


def read_api_key(env_name: str | None, key_file: Path | None) -> str | None:
    """The key from ``key_file`` if given, else from ``$env_name``; never printed or stored."""
    if key_file is not None:
        try:
            key = key_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"the API key file {key_file} is empty")
        return key
    if env_name:
        return os.environ.get(env_name) or None
    return None


def server_urls(given: list[str] | None, serve: Path | None) -> tuple[list[str], str | None]:
    """The servers to ask, and the service they are the replicas of: ``--url``'s; else, with no
    ``--serve``, the target service's (the runner sets ``$EYRIE_SERVICE_TARGET_URLS`` for a step that
    uses it) or ``$EYRIE_TARGET_URL``'s; each checked. A ValueError unless there are servers or a
    model to serve, not both."""
    urls, source, service = given or [], "--url", None
    if not urls and not serve:
        if urls := service_urls(TARGET_SERVICE):
            source, service = f"${TARGET_URLS_ENV}", TARGET_SERVICE
        elif os.environ.get(TARGET_URL_ENV):
            urls, source = os.environ[TARGET_URL_ENV].split(","), f"${TARGET_URL_ENV}"
    urls = [server_url(source, u) for u in urls]
    if bool(urls) == bool(serve):
        raise ValueError(
            f"give the server with --url or ${TARGET_URL_ENV} (or a `{TARGET_SERVICE}` service the step "
            "uses), or a model folder with --serve"
        )
    return urls, service


@settings_options(GenerateSettings, checks_itself=True)
def generate(
    prompts: Annotated[Path, typer.Argument(help="prompts.jsonl from the prep step.")],
    url: Annotated[
        list[str] | None, typer.Option(metavar="URL", help="OpenAI-compatible server base URL (repeatable).")
    ] = None,
    serve: Annotated[
        Path | None,
        typer.Option(help="Serve this model folder (or GGUF file) with `transformers serve` meanwhile."),
    ] = None,
    continuous_batching: Annotated[
        bool, typer.Option(help="With --serve: decode requests in flight together (paged attention).")
    ] = False,
    api_key_env: Annotated[str | None, typer.Option(help="Env var holding the API key.")] = "OPENAI_API_KEY",
    api_key_file: Annotated[Path | None, typer.Option(help="File holding the API key.")] = None,
    out_dir: OutDir = None,
    **settings: Any,
) -> None:
    """Prompts -> conversations.jsonl through the target model: resumable, retried, never the bottleneck."""
    from rich.console import Console

    from pipeline.steps.generate.driver import generate as run_generation
    from pipeline.steps.serving.step_server import ServeError, transformers_serve
    from pipeline.steps.target import TargetError, resolved

    try:
        urls, service = server_urls(url, serve)
        api_key = read_api_key(api_key_env, api_key_file)
    except ValueError as exc:
        say_error(str(exc))
        raise typer.Exit(EXIT_BAD_INPUT) from None
    config = validated(
        GenerateConfig,
        **settings,
        prompts=prompts.resolve(),
        urls=urls,
        service=service,
        api_key=api_key,
        out_dir=(out_dir or step_dir_from_env()).resolve(),
    )
    stop_when_checking()
    with contextlib.ExitStack() as stack:
        if serve is not None:
            log = config.out_dir / "serve.log"
            try:
                # A GGUF file is served as the folder it converts into, which requests then name.
                serve = Path(resolved(serve, "--serve"))
                served = stack.enter_context(
                    transformers_serve(
                        serve,
                        log,
                        startup_timeout_s=config.health_timeout_s,
                        continuous_batching=continuous_batching,
                    )
                )
            except (ServeError, TargetError) as exc:
                say_error(str(exc))
                raise typer.Exit(EXIT_BAD_INPUT) from None
            config.urls = [served]
            config.model = config.model or str(serve.resolve())
        raise typer.Exit(run_generation(config, Console(stderr=True, soft_wrap=True)))
