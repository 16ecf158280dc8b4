"""Training's precision: bf16 where the device multiplies it fast, fp32 else, chosen or forced."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.steps.train import checkpoint as ckpt
from pipeline.steps.train import precision
from pipeline.steps.train.loop import TrainConfig, run_key, train
from pipeline.steps.train.precision import cpu_bf16_is_fast, cpu_flags, resolve


@pytest.mark.parametrize(
    ("capability", "flags", "fast"),
    [
        ("AVX2", {"avx2", "fma"}, False),  # this project's CI machines: bf16 would be emulated
        ("AVX512", {"avx512f", "avx512bw"}, False),  # AVX-512 without its BF16 extension
        ("AVX512", {"avx512f", "avx512_bf16"}, True),  # Cooper Lake, Zen 4
        ("AVX512", {"avx512f", "amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
        ("AVX2", {"avx2", "avx512_bf16"}, False),  # torch dispatches AVX2 kernels here
        ("SVE256", {"sve", "bf16"}, True),  # Graviton 3, Neoverse V1
        ("DEFAULT", {"asimd", "bf16"}, True),  # Arm NEON with BF16
        ("DEFAULT", {"asimd"}, False),
    ],
)
def test_a_cpu_is_fast_at_bf16_only_with_bf16_instructions_torch_uses(capability, flags, fast):
    assert cpu_bf16_is_fast(capability, frozenset(flags)) is fast


def test_cpu_flags_are_read_from_cpuinfo_on_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "sve", "bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_is_bf16_on_a_gpu_with_it_and_fp32_on_any_cpu_and_a_choice_is_kept(monkeypatch):
    precision.fast_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve("auto", "cuda") == "bf16"
    # A CPU with AMX: still fp32, as measured (bf16 decoded 8.5% fewer tokens a forward).
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert resolve("auto", "cpu") == "fp32"
    assert precision.emulated_note("bf16", "cpu") is None  # its own bf16 instructions
    precision.fast_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve("auto", "cuda") == "fp32"
    assert resolve("bf16", "cpu") == "bf16" and resolve("fp32", "cuda") == "fp32"
    precision.fast_bf16.cache_clear()


def test_bf16_on_a_cpu_without_bf16_instructions_is_told_it_is_emulated(monkeypatch):
    precision.fast_bf16.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    note = precision.emulated_note("bf16", "cpu")
    assert note is not None and "AVX2" in note and "emulated" in note
    assert precision.emulated_note("fp32", "cpu") is None
    precision.fast_bf16.cache_clear()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("precision")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 96, (20 + i % 8,), generator=generator).tolist() for i in range(24)]
    rows = {"input_ids": ids, "loss_mask": [[0] * 6 + [1] * (len(r) - 6) for r in ids]}
    (root / "shards").mkdir()
    pq.write_table(pa.table(rows), root / "shards" / "shard-00000.parquet")
    return {"root": root, "target": root / "target", "data": root / "shards"}


def _config(tiny: dict[str, Path], out: str, **update) -> TrainConfig:
    return TrainConfig(
        data=tiny["data"],
        target=tiny["target"],
        out_dir=tiny["root"] / out,
        draft_vocab_size=48,
        ttt_steps=2,
        batch_size=2,
        max_steps=8,
        checkpoint_every=4,
        log_every=4,
        lr=1e-3,
        threads=1,
        heldout_fraction=0.1,
        **update,
    )


def _weights(result: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result["draft"].state_dict().items()}


def test_bf16_holds_the_target_in_bf16_and_keeps_fp32_masters_deterministically_and_resumes_bitwise(tiny):
    cfg = _config(tiny, "bf16", precision="bf16")
    result = train(cfg, log=lambda _: None)
    assert result["summary"]["precision"] == "bf16"
    assert result["target"].dtype == torch.bfloat16  # held as it computes: half the memory of fp32
    draft = result["draft"]
    assert {p.dtype for p in draft.parameters()} == {torch.float32}  # master weights
    state = ckpt.load(cfg.out_dir / "checkpoints" / run_key(cfg, 1), 8)
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k != "step"]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert torch.isfinite(torch.tensor(result["summary"]["final"]["loss"]))

    again = train(_config(tiny, "bf16-again", precision="bf16"), log=lambda _: None)
    first, second = _weights(result), _weights(again)
    assert all(torch.equal(first[k], second[k]) for k in first), "one-thread bf16 runs differ"

    resumed_cfg = _config(tiny, "bf16-resumed", precision="bf16")
    train(resumed_cfg, log=lambda _: None)
    run = resumed_cfg.out_dir / "checkpoints" / run_key(resumed_cfg, 1)
    shutil.rmtree(ckpt.complete(run)[-1])  # as if killed after step 4's checkpoint
    assert ckpt.latest_step(run) == 4
    resumed = train(resumed_cfg, log=lambda _: None)
    assert resumed["summary"]["resumed_from_step"] == 4
    after = _weights(resumed)
    assert all(torch.equal(first[k], after[k]) for k in first), "a resumed bf16 run is not bitwise"


def test_bf16_computes_otherwise_than_fp32_and_trains_apart(tiny):
    bf16 = _config(tiny, "apart-bf16", precision="bf16")
    fp32 = _config(tiny, "apart-fp32", precision="fp32")
    assert run_key(bf16, 1) != run_key(fp32, 1)
    assert run_key(_config(tiny, "x", precision="auto"), 1) == run_key(
        _config(tiny, "x", precision=resolve("auto")), 1
    )  # auto is keyed as it resolved: a rerun that names it resumes the same training
    a, b = train(fp32, log=lambda _: None), train(bf16, log=lambda _: None)
    assert a["summary"]["precision"] == "fp32" and a["target"].dtype == torch.float32
    assert a["summary"]["final"]["loss"] != b["summary"]["final"]["loss"]  # autocast really ran
