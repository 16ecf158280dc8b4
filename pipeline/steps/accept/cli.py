"""``eyrie accept``: its options, over ``accept.accept``. The held-out rows are the ones training
held out, so their defaults are training's (``steps/records.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.steps.accept.accept import ENGINES
from pipeline.steps.options import ReleaseTarget, TrustRemoteCode, duration_option
from pipeline.steps.records import HELDOUT_FRACTION, MAX_LENGTH


def accept(
    draft: Annotated[Path, typer.Option(help="The exported draft (the train step's draft/).")],
    target: Annotated[str, typer.Option(help="The target: a model folder or a hub id.")],
    data: Annotated[Path, typer.Option(help="The tokenize step's shards (held-out rows are the prompts).")],
    engine: Annotated[
        str, typer.Option(help=f"{ENGINES[0]!r} (serve target + draft on the GPUs) or {ENGINES[1]!r} (CPU).")
    ] = ENGINES[0],
    num_steps: Annotated[int, typer.Option(help="Draft passes per target forward (SGLang's).")] = 3,
    topk: Annotated[int, typer.Option(help="Branches per draft pass (SGLang's eagle top-k).")] = 1,
    num_draft_tokens: Annotated[int, typer.Option(help="Tokens verified per target forward.")] = 4,
    heldout_fraction: Annotated[
        float, typer.Option(help="The fraction training held out.")
    ] = HELDOUT_FRACTION,
    max_length: Annotated[
        int, typer.Option(help="Row length training used.")
    ] = MAX_LENGTH,
    prompts: Annotated[int, typer.Option(min=1, help="Held-out prompts measured.")] = 64,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens decoded per prompt.")] = 256,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight (sglang).")] = 16,
    tp: Annotated[int, typer.Option(help="SGLang tensor parallelism: the GPUs it spans (sglang).")] = 1,
    startup_timeout: Annotated[
        str, typer.Option(metavar="DURATION", help="Wait this long for each server.")
    ] = "60m",
    request_timeout: Annotated[
        str, typer.Option(metavar="DURATION", help="Give up on one request after this long (sglang).")
    ] = "10m",
    trust_remote_code: TrustRemoteCode = False,
    reasoning_parser: Annotated[
        str, typer.Option(help="SGLang's --reasoning-parser, as the target is served (empty: none).")
    ] = "",
    tool_call_parser: Annotated[
        str, typer.Option(help="SGLang's --tool-call-parser, as the target is served (empty: none).")
    ] = "",
    release_target: ReleaseTarget = "no",
    out_dir: Annotated[
        Path | None, typer.Option(help="Where accept.json goes (default: the step dir, else the cwd).")
    ] = None,
) -> None:
    """Accept length and output tokens/s of the draft, against the same decoder without it."""
    from pipeline.run.step_contract import EXIT_BAD_INPUT, say_error
    from pipeline.steps.accept.accept import Settings
    from pipeline.steps.accept.accept import accept as run_accept
    from pipeline.steps.sglang import Parsers, Speculation, release_url

    try:
        startup_timeout_s = duration_option("--startup-timeout", startup_timeout)
        request_timeout_s = duration_option("--request-timeout", request_timeout)
    except ValueError as exc:
        say_error(str(exc))
        raise typer.Exit(EXIT_BAD_INPUT) from None
    settings = Settings(
        draft=draft, target=target, data=data, engine=engine,  # type: ignore[arg-type]
        speculation=Speculation(draft, num_steps, topk, num_draft_tokens),
        heldout_fraction=heldout_fraction, max_length=max_length, prompts=prompts,
        max_new_tokens=max_new_tokens, concurrency=concurrency, tp=tp,
        trust_remote_code=trust_remote_code, release_target=release_url(release_target),
        startup_timeout_s=startup_timeout_s, request_timeout_s=request_timeout_s,
        parsers=Parsers(reasoning_parser, tool_call_parser),
    )  # fmt: skip
    raise typer.Exit(run_accept(settings, out_dir))
