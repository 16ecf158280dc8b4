"""``eyrie generate``: options to a ``GenerateConfig``, the API key from env or file, a local server."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeline.memory.units import parse_duration
from pipeline.run.step_contract import step_dir_from_env
from pipeline.steps.generate.config import GenerateConfig, Retry, Sampling
from pipeline.steps.generate.conversation import MODES
from pipeline.steps.generate.driver import EXIT_BAD_INPUT, generate
from pipeline.steps.generate.serve import ServeError, transformers_serve

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


def generate_command(
    prompts: Path,
    *,
    urls: list[str],
    serve: Path | None,
    continuous_batching: bool,
    model: str | None,
    mode: str,
    concurrency: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int | None,
    chat_template_kwargs: str | None,
    drop_truncated: bool,
    retry_errors: bool,
    restart: bool,
    max_retries: int,
    retry_base: float,
    max_error_rate: float,
    error_window: int,
    request_timeout: str,
    health_timeout: str,
    api_key_env: str | None,
    api_key_file: Path | None,
    limit: int | None,
    out_dir: Path | None,
) -> int:
    console = Console(stderr=True, soft_wrap=True)
    try:
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not urls and not serve and os.environ.get(TARGET_URL_ENV):
            # The compose file's pipeline service names the SGLang server for every step.
            urls = os.environ[TARGET_URL_ENV].split(",")
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
            request_timeout_s=parse_duration(request_timeout),
            health_timeout_s=parse_duration(health_timeout),
            retry=Retry(max_retries=max_retries, base_s=retry_base),
            max_error_rate=max_error_rate,
            error_window=error_window,
            api_key=read_api_key(api_key_env, api_key_file),
            limit=limit,
        )
    except ValueError as exc:
        console.print(f"generate: {exc}", markup=False, highlight=False)
        return EXIT_BAD_INPUT
    with contextlib.ExitStack() as stack:
        if serve is not None:
            try:
                url = stack.enter_context(
                    transformers_serve(
                        serve,
                        config.out_dir / "serve.log",
                        startup_timeout_s=config.health_timeout_s,
                        continuous_batching=continuous_batching,
                    )  # fmt: skip
                )
            except ServeError as exc:
                console.print(f"generate: {exc}", markup=False, highlight=False)
                return EXIT_BAD_INPUT
            config.urls = [url]
            config.model = config.model or str(serve.resolve())
        return generate(config, console)
