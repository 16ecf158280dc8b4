"""``eyrie accept``: the exported draft against its target, on sets of prompts (``sets.py``): the
rows training held out (the default), public benchmarks (MT-bench, HumanEval), or a file of the
user's own conversations, each rendered with the target's chat template.

Two measurements, one with speculation and one without, at the same batch: the accept length
(tokens yielded per verifying target forward, pooled over requests) and the output tokens/s of
each, so the speed-up is a ratio of wall-clock rates measured side by side. Each set has its own
figures (a draft may do well on one kind of prompt and badly on another); the top-level ones pool
every set's requests.

- ``sglang`` (a GPU host): SGLang serves the target with the draft
  (``--speculative-algorithm EAGLE3``), then the same server without it; each set's prompts
  go to its native ``/generate`` as token ids, greedy, ``concurrency`` in flight. The
  accept length is SGLang's own count: completion tokens / verify forwards.
- ``chain`` (CPU): the built-in chain decoding (``pipeline.steps.eagle3.decoding``, both models
  on their caches), K draft tokens per target forward, one request at a time, against the
  target's own greedy ``generate``, the two taking turns prompt by prompt. Their outputs must
  equal each other token for token (greedy verification is lossless): a difference fails the
  step. It also gives the acceptance rate at each draft position.

Both check the draft folder first: every tensor its class holds, by name and shape, for this
target (SGLang would skip an unknown tensor and leave a missing one random). With ``--topk 1``
both verify ``num_steps + 1`` tokens per target forward, as SGLang does whatever
``--num-draft-tokens`` says; the settings recorded are those that ran.

Exit codes: 0 measured; 1 failed (a server that would not start or answer through its retries,
decoding that changed the target's output); 2 bad settings or input, in one line; 128+N stopped by
signal N.

Writes ``accept.json`` and the step's manifest (both figures in its stats, which the report shows).
"""

from __future__ import annotations

import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.exits import EXIT_BAD_INPUT, EXIT_FAILED, say_error
from pipeline.contract.step import step_dir_from_env, write_manifest
from pipeline.steps.accept.config import AcceptRun
from pipeline.steps.accept.sets import HELDOUT, SetError, read_set, rendered
from pipeline.steps.serving.sglang import (
    SGLangRefused,
    SGLangUnavailable,
    Terminated,
    generate,
    gpus_released,
    sglang_server,
)
from pipeline.steps.serving.step_server import ServeError
from pipeline.steps.target import TargetError, check_target, load_tokenizer, target_config
from pipeline.steps.target.vision_language import language_config

RESULT = "accept.json"
CHAIN_PROGRESS_EVERY = 4
"""Prompts between the chain engine's progress lines (a prompt takes seconds on a CPU)."""
# SpecForge's own benchmark averages per-request means instead: a short answer weighs as much as a long one.
ACCEPT_LENGTH_IS = "pooled over requests: completion tokens / verifying forwards, as SGLang and vLLM count it"

console = Console(stderr=True, soft_wrap=True)


class AcceptError(ValueError):
    """Wrong settings or inputs: one line."""


class DecodingMismatch(RuntimeError):
    """Speculative decoding changed the target's greedy output: a bug, the step fails."""


def check(settings: AcceptRun) -> None:
    """The inputs: the draft, the rows, the target, and the draft made for it (the settings
    themselves are checked as they are read, by ``config.AcceptConfig``)."""
    if not (settings.draft / "config.json").is_file():
        raise AcceptError(f"--draft {settings.draft} is not an exported draft (no config.json): run train")
    if HELDOUT in settings.bench and not (settings.data and settings.data.exists()):
        raise AcceptError(f"--data {settings.data} does not exist (run tokenize first)")
    try:
        check_target(settings.target, "--target")
        target = language_config(target_config(settings.target, trust_remote_code=settings.trust_remote_code))
    except TargetError as exc:
        raise AcceptError(str(exc)) from None
    from pipeline.steps.eagle3.export import check_draft  # torch: imported when a draft is checked

    try:
        check_draft(settings.draft, target)
    except ValueError as exc:
        raise AcceptError(f"--draft {exc}") from None


def heldout_prompts(settings: AcceptRun) -> list[list[int]]:
    """The prompts (tokens before the first assistant token) of the rows training held out."""
    from pipeline.steps.eagle3.decoding import prompt_of
    from pipeline.steps.shards import load_shards, split_heldout

    # The rows are mapped from a file of their own, as training maps them, beside the step's outputs
    # (not /tmp, which may be small); the prompts are copied out of it, so it goes once they are read.
    with tempfile.TemporaryDirectory(prefix=".rows-", dir=".") as folder:
        rows = load_shards(settings.data, settings.max_length, Path(folder) / "rows.arrow")
        _, heldout = split_heldout(rows, settings.heldout_fraction)
        prompts = [prompt_of(row.input_ids, row.loss_mask) for row in heldout]
    prompts = [p for p in prompts if len(p) >= 2][: settings.prompts]
    if not prompts:
        raise AcceptError(
            f"no held-out prompt in {settings.data} at --heldout-fraction {settings.heldout_fraction} "
            "(use the fraction training used, or more data)"
        )
    return prompts


def _tokenizer(settings: AcceptRun):
    try:
        return load_tokenizer(
            settings.target, trust_remote_code=settings.trust_remote_code, option="--target"
        )
    except TargetError as exc:
        raise AcceptError(str(exc)) from None


def prompt_sets(settings: AcceptRun) -> dict[str, list[list[int]]]:
    """Each set's first ``prompts`` prompts as token ids. Every set is read before the tokenizer
    loads, so that a bad file is said at once."""
    try:
        named = {name: read_set(name)[: settings.prompts] for name in settings.bench if name != HELDOUT}
    except SetError as exc:
        raise AcceptError(str(exc)) from None
    tokenizer = _tokenizer(settings) if named else None
    sets = {}
    for name in dict.fromkeys(settings.bench):
        if name == HELDOUT:
            sets[name] = heldout_prompts(settings)
            continue
        try:
            sets[name] = [rendered(tokenizer, conversation) for conversation in named[name]]
        except ValueError as exc:  # transformers' word for a tokenizer without a chat template
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AcceptError(
                f"--target {settings.target}: its tokenizer cannot render --bench {name}: {reason}"
            ) from None
    return sets


@dataclass
class Tally:
    """What one run over a set's prompts counted, raw, so that runs over several sets add up exactly."""

    seconds: float = 0.0
    output_tokens: int = 0
    verify_forwards: int = 0
    yielded: list[int] = field(default_factory=list)
    """The chain's: the tokens each verifying forward yielded, for the rate at each draft position."""

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.seconds + other.seconds,
            self.output_tokens + other.output_tokens,
            self.verify_forwards + other.verify_forwards,
            self.yielded + other.yielded,
        )

    def run(self, k: int) -> dict:
        forwards = self.verify_forwards
        return {
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "output_tokens_per_s": round(self.output_tokens / self.seconds, 2),
            "verify_forwards": forwards or None,
            # As SGLang counts it, pooled over the requests: completion tokens over verifying forwards
            # (the prompt's own forward, which yields the first token, is not one).
            "accept_length": round(self.output_tokens / forwards, 3) if forwards else None,
            "acceptance_rate_per_position": acceptance_rates(self.yielded, k) if self.yielded else None,
        }


Measured = dict[str, tuple[Tally, Tally]]
"""Each set's tallies: with the draft, then without."""


def _server_run(url: str, prompts: list[list[int]], settings: AcceptRun) -> Tally:
    """Every prompt through ``url``, ``concurrency`` in flight, after one warm-up request."""

    def complete(prompt: list[int], max_new_tokens: int) -> dict:
        return generate(url, prompt, max_new_tokens, settings.request_timeout_s, settings.retry)

    complete(prompts[0], 8)
    started = time.monotonic()
    with ThreadPoolExecutor(settings.concurrency) as pool:
        metas = list(pool.map(lambda p: complete(p, settings.max_new_tokens), prompts))
    seconds = time.monotonic() - started
    tokens = sum(m["completion_tokens"] for m in metas)
    return Tally(seconds, tokens, sum(m.get("spec_verify_ct", 0) for m in metas))


def measure_sglang(settings: AcceptRun, sets: dict[str, list[list[int]]], logs: Path) -> Measured:
    runs: dict[str, dict[str, Tally]] = {name: {} for name in sets}
    with gpus_released(settings.release_target, logs, retry=settings.retry):
        for name, speculation in (("speculative", settings.speculation), ("baseline", None)):
            how = "with" if speculation else "without"
            count = sum(map(len, sets.values()))
            console.print(f"accept: SGLang {how} the draft, {count} prompts", markup=False)
            with sglang_server(
                settings.target,
                logs / f"sglang-{name}.log",
                tp=settings.tp,
                trust_remote_code=settings.trust_remote_code,
                parsers=settings.parsers,
                speculation=speculation,
                startup_timeout_s=settings.startup_timeout_s,
            ) as url:
                for set_name, prompts in sets.items():
                    runs[set_name][name] = _server_run(url, prompts, settings)
    return {name: (run["speculative"], run["baseline"]) for name, run in runs.items()}


def acceptance_rates(per_forward: list[int], k: int) -> list[float]:
    """The share of verifying forwards that kept the draft at each position 1..K (vLLM's rate per
    position): a forward keeps its i-th draft when it yields more than i tokens."""
    return [round(sum(n > i for n in per_forward) / len(per_forward), 4) for i in range(1, k + 1)]


def _chain_set(
    name: str, decoder, target, prompts: list[list[int]], k: int, settings: AcceptRun
) -> tuple[Tally, Tally]:
    """One set at batch 1: each prompt decoded with the draft (``decoder``, a ``ChainDecoder``) and
    by the target's own ``generate``, each timed, taking turns (which goes first alternates), so a
    machine busier at one moment weighs on both alike; a line of progress every few prompts."""
    from pipeline.steps.eagle3.decoding import eos_ids_of, greedy_generate

    eos_ids = eos_ids_of(target)
    seconds = {"speculative": 0.0, "baseline": 0.0}
    speculative, baseline, per_forward = [], [], []
    for number, prompt in enumerate(prompts, 1):
        for which in ("speculative", "baseline") if number % 2 else ("baseline", "speculative"):
            started = time.monotonic()
            if which == "speculative":
                tokens, yielded = decoder.generate(prompt, k, settings.max_new_tokens, eos_ids)
                speculative.append(tokens)
                per_forward += yielded
            else:
                baseline.append(greedy_generate(target, prompt, settings.max_new_tokens, eos_ids))
            seconds[which] += time.monotonic() - started
        if number % CHAIN_PROGRESS_EVERY == 0 or number == len(prompts):
            so_far = sum(map(len, speculative)) / len(per_forward)
            _say(f"{name}: {number}/{len(prompts)} prompts, accept length so far {so_far:.2f}")
    if speculative != baseline:
        differ = sum(a != b for a, b in zip(speculative, baseline, strict=True))
        raise DecodingMismatch(
            f"speculative decoding changed {differ} of {len(prompts)} of the target's greedy outputs on "
            f"{name}: the draft's tokens must only ever be kept where the target agrees (a bug, not a "
            "draft quality issue)"
        )
    spec = Tally(seconds["speculative"], sum(map(len, speculative)), len(per_forward), per_forward)
    return spec, Tally(seconds["baseline"], sum(map(len, baseline)))


def measure_chain(settings: AcceptRun, sets: dict[str, list[list[int]]]) -> Measured:
    """The cached chain loop against the target's own greedy ``generate`` on the same prompts, one
    request at a time (batch 1), wall-clock."""
    import torch

    from pipeline.steps.eagle3.decoding import ChainDecoder, eos_ids_of, greedy_generate
    from pipeline.steps.eagle3.export import load_draft
    from pipeline.steps.target import load_model

    target = load_model(settings.target, dtype=torch.float32, trust_remote_code=settings.trust_remote_code)
    target.eval()
    decoder = ChainDecoder(target, load_draft(settings.draft, target.get_input_embeddings().weight))
    eos_ids = eos_ids_of(target)
    k = settings.speculation.num_steps
    # One-time costs (first allocations, lazy set-up) out of the timing, as the servers get a warm-up request.
    first = next(iter(sets.values()))[0]
    decoder.generate(first, k, 8, eos_ids)
    greedy_generate(target, first, 8, eos_ids)
    return {name: _chain_set(name, decoder, target, prompts, k, settings) for name, prompts in sets.items()}


def _figures(speculative: Tally, baseline: Tally, k: int) -> dict:
    spec, base = speculative.run(k), baseline.run(k)
    rate = base["output_tokens_per_s"]
    return {
        "accept_length": spec["accept_length"],
        "acceptance_rate_per_position": spec["acceptance_rate_per_position"],
        "output_tokens_per_s": spec["output_tokens_per_s"],
        "baseline_output_tokens_per_s": rate,
        "speedup": round(spec["output_tokens_per_s"] / rate, 3) if rate else None,
        "speculative": spec,
        "baseline": base,
    }


def _result(settings: AcceptRun, sets: dict[str, list[list[int]]], measured: Measured) -> dict:
    """accept.json: the figures pooled over every set's requests, and each set's own."""
    spec = settings.speculation
    pooled = [sum(tallies, Tally()) for tallies in zip(*measured.values(), strict=True)]
    return {
        "engine": settings.engine,
        "target": settings.target,
        "draft": str(settings.draft),
        "prompts": sum(map(len, sets.values())),
        "max_new_tokens": settings.max_new_tokens,
        "num_steps": spec.num_steps,
        "topk": spec.topk,
        "num_draft_tokens": spec.num_draft_tokens,
        "accept_length_is": ACCEPT_LENGTH_IS,
        **_figures(*pooled, spec.num_steps),
        "sets": {
            name: {"prompts": len(sets[name]), **_figures(*tallies, spec.num_steps)}
            for name, tallies in measured.items()
        },
    }


def _say(message: str) -> None:
    console.print(f"eyrie accept: {message}", markup=False, highlight=False)


def run_accept(settings: AcceptRun, out_dir: Path | None = None) -> int:
    step_dir = Path(out_dir) if out_dir else step_dir_from_env()
    try:
        check(settings)
        sets = prompt_sets(settings)
    except AcceptError as exc:
        say_error(str(exc))
        return EXIT_BAD_INPUT
    served = settings.speculation.as_served()
    if served != settings.speculation:
        _say(
            f"with --topk 1 the draft is one chain of --num-steps {served.num_steps}: "
            f"{served.num_draft_tokens} tokens verified per target forward, not --num-draft-tokens "
            f"{settings.speculation.num_draft_tokens} (as SGLang runs it)"
        )
        settings = settings.model_copy(update={"num_draft_tokens": served.num_draft_tokens})
    try:
        if settings.engine == "sglang":
            measured = measure_sglang(settings, sets, step_dir)
        else:
            measured = measure_chain(settings, sets)
    except (TargetError, SGLangRefused) as exc:
        say_error(str(exc))
        return EXIT_BAD_INPUT
    except (SGLangUnavailable, ServeError, DecodingMismatch) as exc:
        say_error(str(exc))
        return EXIT_FAILED
    except Terminated as exc:
        say_error(str(exc))
        return 128 + exc.signum
    result = _result(settings, sets, measured)
    atomic_write_text(step_dir / RESULT, json.dumps(result, indent=2) + "\n")
    write_manifest(step_dir, [RESULT], stats=result)
    for name, figures in [*result["sets"].items(), *([("all sets", result)] if len(sets) > 1 else [])]:
        console.print(
            f"accept ({settings.engine}) {name}: accept length {figures['accept_length']} (pooled over "
            f"requests), {figures['output_tokens_per_s']} output tok/s with the draft, "
            f"{figures['baseline_output_tokens_per_s']} without ({figures['speedup']}x)",
            markup=False,
            highlight=False,
        )
    return 0
