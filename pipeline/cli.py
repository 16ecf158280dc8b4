"""The ``eyrie`` command line.

Each command imports its implementation lazily, so ``eyrie --help`` and the
light commands stay fast and never pull in torch or transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.run import EXECUTORS

app = typer.Typer(
    name="eyrie",
    help="An EAGLE-3 draft-model factory: run pipelines whose every memory outcome is recorded.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

RunDir = Annotated[
    Path,
    typer.Option("--run-dir", "-d", help="Run directory holding step outputs and the ledger."),
]
ReadRunDir = Annotated[
    Path | None,
    typer.Option(
        "--run-dir", "-d", help="Run directory holding the ledger (default: the latest run under runs/)."
    ),
]
RUNS = Path("runs")
DEFAULT_RUN_DIR = RUNS / "default"
# A permission, not a setting of what is computed: a pipeline grants it through the environment.
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        envvar="EYRIE_TRUST_REMOTE_CODE",
        help="Run the code the target ships (auto_map in its config; Kimi-K2 needs it).",
    ),
]
ReleaseTarget = Annotated[
    str,
    typer.Option(
        help="SGLang server (URL) whose GPU memory this step takes while it runs, or 'no'.",
    ),
]


@app.command()
def run(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    run_dir: RunDir = DEFAULT_RUN_DIR,
    executor: Annotated[
        str, typer.Option(help=f"Where steps run: {', '.join(EXECUTORS)} (local: a cgroup per step here).")
    ] = "local",
) -> None:
    """Run a pipeline: each step in its own memory-limited cgroup, every attempt in the ledger."""
    from pipeline.run.cli import run_command

    raise typer.Exit(run_command(pipeline_file, run_dir, executor))


@app.command()
def status(
    run_dir: ReadRunDir = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print attempts as JSON (with --follow: one view a line).")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Watch the latest run live until it ends; exit as it did.")
    ] = False,
) -> None:
    """Show every attempt of every step: verdict, exit, peak/limit, OOM kills, duration."""
    from pipeline.report.status import status_command

    raise typer.Exit(status_command(run_dir, RUNS, json_output, follow))


@app.command()
def explain(
    step: Annotated[str, typer.Argument(help="Step name.")],
    run_dir: ReadRunDir = None,
    attempt: Annotated[int | None, typer.Option(help="Attempt number (default: last).")] = None,
) -> None:
    """Say in plain words why a step's attempt ended as it did, with the evidence."""
    from pipeline.report.status import explain_command

    raise typer.Exit(explain_command(run_dir, RUNS, step, attempt))


@app.command()
def report(
    run_dir: ReadRunDir = None,
    out: Annotated[
        Path | None, typer.Option(help="Where to write the HTML (default RUN_DIR/report.html).")
    ] = None,
) -> None:
    """Write an HTML report: the run chart (host, steps, budget, Gantt), every attempt and its timeline."""
    from pipeline.report.html import report_command

    raise typer.Exit(report_command(run_dir, RUNS, out))


@app.command()
def memory(
    json_output: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Show the memory this process really has: cgroup limits, usage, MemAvailable, budget."""
    from pipeline.report.memory import memory_command

    raise typer.Exit(memory_command(json_output))


@app.command()
def manifest(
    outputs: Annotated[
        list[Path],
        typer.Argument(
            metavar="OUTPUT", help="The step's finished outputs (files or folders in its directory)."
        ),
    ],
) -> None:
    """Declare a step's outputs complete: hash them into its manifest.json, as the Python API does."""
    from pipeline.run.step_contract import manifest_command

    raise typer.Exit(manifest_command(outputs))


@app.command()
def prep(
    catalog: Annotated[
        Path | None,
        typer.Option(help="Catalog YAML of sources, or 'default' (the shipped ten-source mix, the default)."),
    ] = None,
    offline: Annotated[
        bool,
        typer.Option(
            "--offline/--online",
            help="Read each source's local 'sample:' file (offline) or the hub and local files (online).",
        ),
    ] = False,
    quota: Annotated[
        int, typer.Option(min=0, help="At most N records per source; 0: the catalog's own quotas.")
    ] = 0,
    out_dir: Annotated[
        Path | None, typer.Option(help="Where outputs go (default: the step dir, else the cwd).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Shuffle seed (default: the catalog's).")] = None,
    workers: Annotated[
        int | None, typer.Option(help="At most this many sources at once (default: what memory allows).")
    ] = None,
    worker_memory: Annotated[
        str, typer.Option(help="Memory one source's worker may use; divides the budget into workers.")
    ] = "512MiB",
) -> None:
    """Sources -> prompts.jsonl, native.jsonl and native_tokenized.parquet, with per-source counts."""
    from pipeline.steps.prep.prep import prep as run_prep

    raise typer.Exit(
        run_prep(
            catalog, out_dir, offline=offline, seed=seed, quota=quota or None, workers=workers,
            worker_memory=worker_memory,
        )  # fmt: skip
    )


@app.command()
def tokenize(
    tokenizer: Annotated[str, typer.Option(help="The target: a model folder or a hub id (its tokenizer).")],
    conversations: Annotated[
        list[Path] | None, typer.Option(help="A conversations .jsonl file (repeatable).")
    ] = None,
    tokenized: Annotated[
        list[Path] | None, typer.Option(help="A pre-tokenized .parquet file (repeatable).")
    ] = None,
    chat_template: Annotated[
        str, typer.Option(help="'tokenizer' (the folder's own), 'kimi-k2', or a .jinja file.")
    ] = "tokenizer",
    max_length: Annotated[int, typer.Option(help="Truncate rows to this many tokens.")] = 4096,
    shard_rows: Annotated[int, typer.Option(help="Rows per parquet shard.")] = 8192,
    out_dir: Annotated[
        Path | None, typer.Option(help="Where shards/ goes (default: the step dir, else the cwd).")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1, help="Processes rendering and tokenizing (default: what memory allows, one per CPU)."
        ),
    ] = None,
    worker_memory: Annotated[
        str, typer.Option(help="Memory one worker may use; divides the budget into workers.")
    ] = "256MiB",
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Conversations -> parquet shards of input_ids and an assistant-only loss_mask."""
    from pipeline.steps.tokenize.tokenize import tokenize as run_tokenize

    raise typer.Exit(
        run_tokenize(
            tokenizer,
            conversations or [],
            tokenized or [],
            out_dir,
            chat_template=chat_template,
            max_length=max_length,
            shard_rows=shard_rows,
            workers=workers,
            worker_memory=worker_memory,
            trust_remote_code=trust_remote_code,
        )
    )


@app.command()
def generate(
    prompts: Annotated[Path, typer.Argument(help="prompts.jsonl from the prep step.")],
    url: Annotated[
        list[str] | None, typer.Option(help="OpenAI-compatible server base URL (repeatable).")
    ] = None,
    serve: Annotated[
        Path | None, typer.Option(help="Serve this model folder with `transformers serve` meanwhile.")
    ] = None,
    continuous_batching: Annotated[
        bool, typer.Option(help="With --serve: decode requests in flight together (paged attention).")
    ] = False,
    model: Annotated[str | None, typer.Option(help="Model name (default: the server's first).")] = None,
    mode: Annotated[str, typer.Option(help="'last_turn' or 'all_turns'.")] = "last_turn",
    concurrency: Annotated[int, typer.Option(help="Requests in flight per server.")] = 32,
    temperature: Annotated[float, typer.Option()] = 0.7,
    top_p: Annotated[float, typer.Option()] = 1.0,
    max_tokens: Annotated[int, typer.Option()] = 2048,
    seed: Annotated[int | None, typer.Option(help="Base seed; each row's seed derives from its id.")] = None,
    chat_template_kwargs: Annotated[
        str | None, typer.Option(help="JSON, e.g. '{\"enable_thinking\": true}'.")
    ] = None,
    drop_truncated: Annotated[
        bool, typer.Option(help="Put rows cut by max_tokens in errors.jsonl instead.")
    ] = False,
    retry_errors: Annotated[bool, typer.Option(help="Ask the ids in errors.jsonl again.")] = False,
    restart: Annotated[
        bool,
        typer.Option(
            envvar="EYRIE_GENERATE_RESTART",
            help="Move earlier rows aside (restarted/) and start over (in a pipeline: the variable, once).",
        ),
    ] = False,
    max_retries: Annotated[
        int, typer.Option(help="Retries of a transient error while the server is up.")
    ] = 6,
    retry_base: Annotated[float, typer.Option(help="First backoff, seconds (doubles).")] = 0.5,
    max_error_rate: Annotated[
        float, typer.Option(help="Stop when this share of the last --error-window rows failed (1: never).")
    ] = 0.5,
    error_window: Annotated[int, typer.Option(help="Rows the error rate is taken over.")] = 200,
    request_timeout: Annotated[str, typer.Option()] = "10m",
    health_timeout: Annotated[
        str, typer.Option(help="Wait this long for a server to answer /health: at start and in an outage.")
    ] = "10m",
    api_key_env: Annotated[str | None, typer.Option(help="Env var holding the API key.")] = "OPENAI_API_KEY",
    api_key_file: Annotated[Path | None, typer.Option(help="File holding the API key.")] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N prompts.")] = None,
    out_dir: Annotated[
        Path | None, typer.Option(help="Where outputs go (default: the step dir, else the cwd).")
    ] = None,
) -> None:
    """Prompts -> conversations.jsonl through the target model: resumable, retried, never the bottleneck."""
    from pipeline.steps.generate.cli import generate_command

    raise typer.Exit(
        generate_command(
            prompts,
            urls=url or [],
            serve=serve,
            continuous_batching=continuous_batching,
            model=model,
            mode=mode,
            concurrency=concurrency,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            chat_template_kwargs=chat_template_kwargs,
            drop_truncated=drop_truncated,
            retry_errors=retry_errors,
            restart=restart,
            max_retries=max_retries,
            retry_base=retry_base,
            max_error_rate=max_error_rate,
            error_window=error_window,
            request_timeout=request_timeout,
            health_timeout=health_timeout,
            api_key_env=api_key_env,
            api_key_file=api_key_file,
            limit=limit,
            out_dir=out_dir,
        )  # fmt: skip
    )


@app.command()
def provision(
    host: Annotated[
        str | None, typer.Option(help="One host: NAME, USER@NAME or USER@NAME:PORT (SSH).")
    ] = None,
    inventory: Annotated[Path | None, typer.Option(help="An Ansible inventory (group gpu_hosts).")] = None,
    check: Annotated[bool, typer.Option("--check", help="Check mode: report, change nothing.")] = False,
    tags: Annotated[
        list[str] | None, typer.Option("--tag", help="Only these roles (repeatable), e.g. docker.")
    ] = None,
    limit: Annotated[str | None, typer.Option(help="Only these inventory hosts (Ansible pattern).")] = None,
    data_dir: Annotated[
        Path,
        typer.Option(
            envvar="EYRIE_PROVISION_DIR", help="Where the generated inventory and run artifacts are kept."
        ),
    ] = Path(".eyrie/ansible"),
) -> None:
    """Turn GPU hosts into verified pipeline hosts: driver, CUDA, Docker, container toolkit."""
    from pipeline.provision.cli import provision_command

    raise typer.Exit(provision_command(host, inventory, check, tags, limit, data_dir))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def verify(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="One host over SSH: NAME or USER@NAME.")] = None,
    inventory: Annotated[Path | None, typer.Option(help="Every gpu_hosts host of an inventory.")] = None,
) -> None:
    """Prove provisioned hosts are right with the testinfra suite (extra args go to pytest)."""
    from pipeline.provision.cli import verify_command

    raise typer.Exit(verify_command(host, inventory, list(ctx.args)))


build_app = typer.Typer(help="Build compiled dependencies under a memory budget.", no_args_is_help=True)
app.add_typer(build_app, name="build")


@build_app.command("flash-attn")
def build_flash_attn(
    version: Annotated[str, typer.Option(help="flash-attn release to fetch from PyPI (sdist).")] = "2.8.3",
    source: Annotated[Path | None, typer.Option(help="An unpacked flash-attn source tree.")] = None,
    archs: Annotated[str, typer.Option(help="'auto' (this host's GPUs) or e.g. '100;120'.")] = "auto",
    budget: Annotated[
        str, typer.Option(help="'auto' (cgroup-aware, less headroom) or a size up to what this process has.")
    ] = "auto",
    threads: Annotated[str, typer.Option(help="nvcc --threads: 'auto' ($NVCC_THREADS if set), or N.")] = (
        "auto"
    ),
    out: Annotated[Path, typer.Option(help="Wheel cache (and sources) directory.")] = Path(".eyrie/wheels"),
    run_dir: Annotated[Path | None, typer.Option(help="Ledger of the compile jobs.")] = None,
    python: Annotated[str | None, typer.Option(help="Python whose torch to build against.")] = None,
    cuda_home: Annotated[str | None, typer.Option(help="CUDA toolkit root (default $CUDA_HOME).")] = None,
    headroom: Annotated[str, typer.Option(help="Kept out of an auto budget.")] = "2GiB",
    cpus: Annotated[
        int | None, typer.Option(help="CPU slots (default: this process's CPUs; $MAX_JOBS caps the jobs).")
    ] = None,
    profile: Annotated[
        list[Path] | None, typer.Option(help="Extra measured profile JSON (repeatable).")
    ] = None,
) -> None:
    """Build a flash-attn wheel: nvcc jobs admitted by measured peak, each in its own cgroup."""
    from pipeline.compile.cli import flash_attn_command

    raise typer.Exit(
        flash_attn_command(
            version=version,
            source=source,
            archs=archs,
            budget=budget,
            threads=threads,
            out=out,
            run_dir=run_dir,
            python=python,
            cuda_home=cuda_home,
            headroom=headroom,
            cpus=cpus,
            profiles=profile or [],
        )  # fmt: skip
    )


@app.command()
def train(
    data: Annotated[Path, typer.Option(help="Tokenized shards (the tokenize step's folder).")],
    target: Annotated[Path, typer.Option(help="The target: a model folder or a hub id.")],
    config: Annotated[Path | None, typer.Option(help="YAML of training settings.")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the step dir).")] = None,
    draft_vocab_size: Annotated[int | None, typer.Option(help="Draft vocabulary (default 32000).")] = None,
    ttt_steps: Annotated[int | None, typer.Option(help="Training-time-test steps K (default 7).")] = None,
    layer_ids: Annotated[str | None, typer.Option(help="Feature layers, e.g. '1,15,28'.")] = None,
    lr: Annotated[float | None, typer.Option()] = None,
    epochs: Annotated[float | None, typer.Option()] = None,
    max_steps: Annotated[
        int | None, typer.Option(help="Optimizer steps (overrides epochs; 0: by epochs).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Rows per process per step.")] = None,
    max_length: Annotated[int | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Steps between checkpoints.")] = None,
    heldout_fraction: Annotated[float | None, typer.Option()] = None,
    eval_prompts: Annotated[int | None, typer.Option(help="Held-out prompts decoded.")] = None,
    eval_max_new_tokens: Annotated[int | None, typer.Option()] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    nproc: Annotated[int | None, typer.Option(help="Processes per node (torchrun).")] = None,
    nnodes: Annotated[int | None, typer.Option(help="Nodes (torchrun).")] = None,
    target_placement: Annotated[
        str | None,
        typer.Option(help="Where the target lives: auto (default), replicated, sharded or offline."),
    ] = None,
    features_dir: Annotated[
        Path | None,
        typer.Option(help="Offline placement: the folder of the target's features (OUT/features)."),
    ] = None,
    trust_remote_code: TrustRemoteCode = False,
    release_target: ReleaseTarget = "no",
) -> None:
    """Train an EAGLE-3 draft on the target's features; export it for SGLang; measure acceptance."""
    from pipeline.steps.sglang import release_url
    from pipeline.steps.train.cli import train_command

    ids = layer_ids.split(",") if layer_ids else None  # checked with the other settings
    raise typer.Exit(
        train_command(
            config,
            data=data,
            target=target,
            out=out,
            draft_vocab_size=draft_vocab_size,
            ttt_steps=ttt_steps,
            layer_ids=ids,
            lr=lr,
            epochs=epochs,
            max_steps=max_steps or None,
            batch_size=batch_size,
            max_length=max_length,
            seed=seed,
            checkpoint_every=checkpoint_every,
            heldout_fraction=heldout_fraction,
            eval_prompts=eval_prompts,
            eval_max_new_tokens=eval_max_new_tokens,
            threads=threads,
            nproc=nproc,
            nnodes=nnodes,
            target_placement=target_placement,
            features_dir=features_dir,
            trust_remote_code=trust_remote_code or None,
            release_target=release_url(release_target),
        )  # fmt: skip
    )


@app.command()
def accept(
    draft: Annotated[Path, typer.Option(help="The exported draft (the train step's draft/).")],
    target: Annotated[str, typer.Option(help="The target: a model folder or a hub id.")],
    data: Annotated[Path, typer.Option(help="The tokenize step's shards (held-out rows are the prompts).")],
    engine: Annotated[
        str, typer.Option(help="'sglang' (serve target + draft on the GPUs) or 'chain' (CPU).")
    ] = "sglang",
    num_steps: Annotated[int, typer.Option(help="Draft passes per target forward (SGLang's).")] = 3,
    topk: Annotated[int, typer.Option(help="Branches per draft pass (SGLang's eagle top-k).")] = 1,
    num_draft_tokens: Annotated[int, typer.Option(help="Tokens verified per target forward.")] = 4,
    heldout_fraction: Annotated[float, typer.Option(help="The fraction training held out.")] = 0.05,
    max_length: Annotated[int, typer.Option(help="Row length training used.")] = 2048,
    prompts: Annotated[int, typer.Option(min=1, help="Held-out prompts measured.")] = 64,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 256,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight (sglang).")] = 16,
    tp: Annotated[int, typer.Option(help="SGLang tensor parallelism: the GPUs it spans (sglang).")] = 1,
    startup_timeout: Annotated[str, typer.Option(help="Wait this long for each server.")] = "60m",
    request_timeout: Annotated[str, typer.Option()] = "10m",
    trust_remote_code: TrustRemoteCode = False,
    release_target: ReleaseTarget = "no",
    out_dir: Annotated[
        Path | None, typer.Option(help="Where accept.json goes (default: the step dir, else the cwd).")
    ] = None,
) -> None:
    """Accept length and output tokens/s of the draft, against the same decoder without it."""
    from pipeline.memory.units import parse_duration
    from pipeline.steps.accept.accept import Settings
    from pipeline.steps.accept.accept import accept as run_accept
    from pipeline.steps.sglang import Speculation, release_url

    settings = Settings(
        draft=draft, target=target, data=data, engine=engine,  # type: ignore[arg-type]
        speculation=Speculation(draft, num_steps, topk, num_draft_tokens),
        heldout_fraction=heldout_fraction, max_length=max_length, prompts=prompts,
        max_new_tokens=max_new_tokens, concurrency=concurrency, tp=tp,
        trust_remote_code=trust_remote_code, release_target=release_url(release_target),
        startup_timeout_s=parse_duration(startup_timeout), request_timeout_s=parse_duration(request_timeout),
    )  # fmt: skip
    raise typer.Exit(run_accept(settings, out_dir))


embedded_app = typer.Typer(help="The embedded default: the tiny target and its data.", no_args_is_help=True)
app.add_typer(embedded_app, name="embedded")


@embedded_app.command("target")
def embedded_target(
    out: Annotated[Path, typer.Option(help="Folder for the model and tokenizer.")] = Path("model"),
) -> None:
    """Write the tiny target (a small Llama and its BPE tokenizer, made from the bundled samples)."""
    from pipeline.embedded.tiny import target_command

    raise typer.Exit(target_command(out))


if __name__ == "__main__":
    app()
