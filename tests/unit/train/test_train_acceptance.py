"""Acceptance for real: a trained draft, a greedy target verifying its chains, on held-out prompts.

The training data is always the target's own greedy output, so a draft that learned
anything shows it as accepted tokens. A random draft yields ~1.0 token per forward.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.steps.eagle3.decoding import eos_ids_of, real_acceptance
from pipeline.steps.train.features import OnlineTarget
from pipeline.steps.train.loop import TrainConfig, simulated_acceptance, train


def _evaluate(cfg: TrainConfig, prompts: int, max_new_tokens: int) -> tuple[dict, dict]:
    result = train(cfg, log=lambda _: None)
    target, draft, heldout = result["target"], result["draft"].eval(), result["heldout"]
    assert len(heldout) >= 8, "too few held-out rows to measure anything"
    source = OnlineTarget(target, result["summary"]["layer_ids"], draft.d2t, draft.t2d)
    simulated = simulated_acceptance(
        source,
        draft,
        heldout,
        cfg.ttt_steps,
        0,
        batch_size=cfg.batch_size,
        loss_chunk=cfg.loss_chunk,
        precision=result["summary"]["precision"],
    )
    real = real_acceptance(
        target, draft, heldout[:prompts], cfg.ttt_steps, max_new_tokens, eos_ids_of(target)
    )
    return simulated, real


def _untrained_draft_acceptance(cfg: TrainConfig, prompts: int, max_new_tokens: int) -> float:
    cfg = cfg.model_copy(update={"max_steps": 1, "lr": 1e-12, "out_dir": cfg.out_dir / "untrained"})
    return _evaluate(cfg, prompts, max_new_tokens)[1]["acceptance_length"]


@pytest.fixture(scope="module")
def random_target_run(tmp_path_factory):
    """A small random-init "bigram" target and its own greedy continuations of random prompts.

    Attention outputs are zeroed, so the target's next token depends on the current token
    only: a fake target whose greedy chains a short training can learn (a fully random one
    needs far longer than a default test may take).
    """
    root = tmp_path_factory.mktemp("acceptance")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=1,
        pad_token_id=0,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target.save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 256, (160, 12), generator=generator)
    with torch.no_grad():
        out = target.generate(prompts, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = {
        "input_ids": out.tolist(),
        "loss_mask": [[0] * 12 + [1] * (out.shape[1] - 12)] * len(out),
        "source": ["random-target-greedy"] * len(out),
    }
    (root / "shards").mkdir()
    pq.write_table(pa.table(rows), root / "shards" / "shard-00000.parquet")
    return TrainConfig(
        data=root / "shards",
        target=root / "target",
        out_dir=root / "train",
        draft_vocab_size=192,
        ttt_steps=4,
        layer_ids=[0, 1, 2],
        lr=1e-2,
        batch_size=8,
        max_steps=80,
        heldout_fraction=0.1,
        checkpoint_every=1000,
        threads=1,
    )


def test_trained_draft_is_accepted_more_than_an_untrained_one(random_target_run):
    """The default-suite check: a short training must lift acceptance well above an untrained draft's."""
    untrained = _untrained_draft_acceptance(random_target_run, prompts=8, max_new_tokens=24)
    simulated, real = _evaluate(random_target_run, prompts=8, max_new_tokens=24)
    assert untrained < 1.3
    # Measured 1.77 (simulated 2.40): tokens first met in a held-out chain stay unpredictable.
    assert real["acceptance_length"] >= 1.5, (simulated, real)
    assert abs(simulated["acceptance_length"] - real["acceptance_length"]) < 1.0, (simulated, real)


def test_the_cpu_benchmark_measures_a_target_that_names_one_end_id(random_target_run):
    """benchmarks/train_cpu.py ran the chain decoding with the target's eos id as a bare int."""
    from benchmarks.train_cpu import measure

    assert random_target_run.model_copy().target  # the bigram target: eos_token_id=1, one int
    bench = random_target_run.out_dir / "bench"
    cfg = random_target_run.model_copy(update={"max_steps": 2, "out_dir": bench})
    figures = measure(cfg, eval_prompts=2, max_new_tokens=8)
    assert figures["verify_forwards"] > 0 and figures["real_acceptance_length"] >= 1.0


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~5 min alone on 2 cores; far longer on a shared, loaded machine
def test_tiny_target_acceptance_at_least_2_5_with_k7(tmp_path):
    """The issue's threshold: the embedded tiny target, its self-distilled data, K=7, held-out prompts."""
    from pipeline.embedded.tiny import ensure_distilled_shards, ensure_tiny_target

    cfg = TrainConfig(
        data=ensure_distilled_shards(),
        target=ensure_tiny_target(),
        out_dir=tmp_path,
        draft_vocab_size=2048,
        ttt_steps=7,
        lr=3e-3,
        batch_size=8,
        max_steps=150,
        heldout_fraction=0.15,
        checkpoint_every=1000,
        threads=1,
    )
    simulated, real = _evaluate(cfg, prompts=16, max_new_tokens=64)
    assert real["acceptance_length"] >= 2.5, (simulated, real)
    assert abs(simulated["acceptance_length"] - real["acceptance_length"]) < 1.5, (simulated, real)
