"""``eyrie generate``: its options (defaults from ``GenerateConfig``), the API key from env or
file, a local server."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.memory.units import duration_text
from pipeline.run.step_contract import error_lines, step_dir_from_env
from pipeline.steps.generate.config import GenerateConfig, Sampling
from pipeline.steps.generate.conversation import MODES
from pipeline.steps.options import OutDir, duration_option, server_url
from pipeline.steps.retry import Retry

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


def generate(
    prompts: Annotated[Path, typer.Argument(help="prompts.jsonl from the prep step.")],
    url: Annotated[
        list[str] | None, typer.Option(metavar="URL", help="OpenAI-compatible server base URL (repeatable).")
    ] = None,
    serve: Annotated[
        Path | None, typer.Option(help="Serve this model folder with `transformers serve` meanwhile.")
    ] = None,
    continuous_batching: Annotated[
        bool, typer.Option(help="With --serve: decode requests in flight together (paged attention).")
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="Model name (default: the server's first).")
    ] = GenerateConfig.model,
    mode: Annotated[str, typer.Option(help=f"{' or '.join(MODES)}.")] = GenerateConfig.mode,
    concurrency: Annotated[
        int, typer.Option(help="Requests in flight per server.")
    ] = GenerateConfig.concurrency,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (0: greedy).")
    ] = Sampling.temperature,
    top_p: Annotated[
        float, typer.Option(help="Nucleus sampling: the smallest set of tokens with this much probability.")
    ] = Sampling.top_p,
    max_tokens: Annotated[
        int, typer.Option(help="Tokens at most in each answer (see --drop-truncated).")
    ] = Sampling.max_tokens,
    seed: Annotated[
        int | None, typer.Option(help="Base seed; each row's seed derives from its id.")
    ] = Sampling.seed,
    chat_template_kwargs: Annotated[
        str | None, typer.Option(help="JSON, e.g. '{\"enable_thinking\": true}'.")
    ] = None,
    drop_truncated: Annotated[
        bool, typer.Option(help="Put rows cut by max_tokens in errors.jsonl instead.")
    ] = GenerateConfig.drop_truncated,
    retry_errors: Annotated[
        bool, typer.Option(help="Ask the ids in errors.jsonl again.")
    ] = GenerateConfig.retry_errors,
    restart: Annotated[
        bool,
        typer.Option(
            envvar="EYRIE_GENERATE_RESTART",
            help="Move earlier rows aside (restarted/) and start over (in a pipeline: the variable, once).",
        ),
    ] = GenerateConfig.restart,
    max_retries: Annotated[
        int, typer.Option(help="Retries of a transient error while the server is up.")
    ] = Retry.max_retries,
    retry_base: Annotated[float, typer.Option(help="First backoff, seconds (doubles).")] = Retry.base_s,
    max_error_rate: Annotated[
        float, typer.Option(help="Stop when this share of the last --error-window rows failed (1: never).")
    ] = GenerateConfig.max_error_rate,
    error_window: Annotated[
        int, typer.Option(help="Rows the error rate is taken over.")
    ] = GenerateConfig.error_window,
    request_timeout: Annotated[
        str, typer.Option(metavar="DURATION", help="Give up on one request after this long (then retried).")
    ] = duration_text(GenerateConfig.request_timeout_s),
    health_timeout: Annotated[
        str,
        typer.Option(
            metavar="DURATION",
            help="Wait this long for a server to answer /health: at start and in an outage.",
        ),
    ] = duration_text(GenerateConfig.health_timeout_s),
    api_key_env: Annotated[str | None, typer.Option(help="Env var holding the API key.")] = "OPENAI_API_KEY",
    api_key_file: Annotated[Path | None, typer.Option(help="File holding the API key.")] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N prompts.")] = GenerateConfig.limit,
    out_dir: OutDir = None,
) -> None:
    """Prompts -> conversations.jsonl through the target model: resumable, retried, never the bottleneck."""
    from rich.console import Console

    from pipeline.run.step_contract import EXIT_BAD_INPUT
    from pipeline.steps.generate.driver import generate as run_generation
    from pipeline.steps.serve import ServeError, transformers_serve

    console = Console(stderr=True, soft_wrap=True)
    urls = url or []
    try:
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not urls and not serve and os.environ.get(TARGET_URL_ENV):
            # The compose file's pipeline service names the SGLang server for every step.
            urls = os.environ[TARGET_URL_ENV].split(",")
        urls = [server_url(f"${TARGET_URL_ENV}" if not url else "--url", u) for u in urls]
        if bool(urls) == bool(serve):
            raise ValueError(
                f"give the server with --url or ${TARGET_URL_ENV}, or a model folder with --serve"
            )
        if concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if not 0 <= max_error_rate <= 1:
            raise ValueError(f"--max-error-rate must be from 0 to 1 (1: never stop), not {max_error_rate}")
        if error_window < 1:
            raise ValueError("--error-window must be at least 1 row")
        template_kwargs: dict[str, Any] | None = None
        if chat_template_kwargs:
            template_kwargs = json.loads(chat_template_kwargs)
            if not isinstance(template_kwargs, dict):
                raise ValueError("--chat-template-kwargs must be a JSON object")
        config = GenerateConfig(
            prompts=prompts.resolve(),
            out_dir=(out_dir or step_dir_from_env()).resolve(),
            urls=list(urls),
            model=model,
            mode=mode,  # type: ignore[arg-type]
            concurrency=concurrency,
            sampling=Sampling(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed),
            chat_template_kwargs=template_kwargs,
            drop_truncated=drop_truncated,
            retry_errors=retry_errors,
            restart=restart,
            request_timeout_s=duration_option("--request-timeout", request_timeout),
            health_timeout_s=duration_option("--health-timeout", health_timeout),
            retry=Retry(max_retries=max_retries, base_s=retry_base),
            max_error_rate=max_error_rate,
            error_window=error_window,
            api_key=read_api_key(api_key_env, api_key_file),
            limit=limit,
        )
    except ValueError as exc:
        console.print(error_lines(str(exc)), markup=False, highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    with contextlib.ExitStack() as stack:
        if serve is not None:
            try:
                served = stack.enter_context(
                    transformers_serve(
                        serve,
                        config.out_dir / "serve.log",
                        startup_timeout_s=config.health_timeout_s,
                        continuous_batching=continuous_batching,
                    )  # fmt: skip
                )
            except ServeError as exc:
                console.print(error_lines(str(exc)), markup=False, highlight=False)
                raise typer.Exit(EXIT_BAD_INPUT) from None
            config.urls = [served]
            config.model = config.model or str(serve.resolve())
        raise typer.Exit(run_generation(config, console))
