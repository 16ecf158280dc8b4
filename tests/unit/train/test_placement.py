"""The placement planner, without GPUs: module sizes come from real configurations built on the meta
device, free memory is given as figures, and the plans are checked against them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

from benchmarks.train_long import allocator_bytes
from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config
from pipeline.steps.train.features import TargetBatch
from pipeline.steps.train.loop import DraftLoss
from pipeline.steps.train.placement import (
    HEADROOM,
    Device,
    PlacementError,
    draft_activations,
    draft_bytes,
    plan,
    target_units,
)

GiB = 1024**3
LENGTH = 2048
DRAFT_VOCAB = 32000

# Shapes as their published config.json files give them.
LLAMA_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
LLAMA_70B = LlamaConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
# A DeepSeek-V3-style mixture of experts (MLA, one dense layer, shared + routed experts), 16B total.
SMALL_MOE = DeepseekV3Config(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    first_k_dense_replace=1,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


def units_of(config):
    return target_units(config, torch.bfloat16, 1, LENGTH, DRAFT_VOCAB, 1024)


def draft_of(config) -> int:
    with torch.device("meta"):
        draft = Eagle3Draft(draft_config(config, DRAFT_VOCAB, default_layer_ids(config.num_hidden_layers)))
    return draft_bytes(draft, LENGTH, LENGTH, 7, 512, 2, recompute=True)


def gpus(count: int, free_gib: float) -> list[Device]:
    return [Device(f"cuda:{i}", int(free_gib * GiB)) for i in range(count)]


def parameters_bytes(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def check_plan(result, config, devices):
    """Every module placed once, layers in order, nothing planned past a device's usable memory."""
    units = units_of(config)
    placed = [m for share in result.shares for m in share.modules]
    assert sorted(placed) == sorted(u.module for u in units)
    layers = [layer for share in result.shares for layer in share.layers]
    assert layers == list(range(config.num_hidden_layers))
    for share in result.shares:
        assert share.planned <= share.device.usable
    assert result.device_map() == {m: s.device.name for s in result.shares for m in s.modules}
    assert result.draft_device == devices[0].name and result.shares[0].draft > 0


def test_sizes_are_transformers_own_count_of_the_model():
    for config in (LLAMA_8B, SMALL_MOE):
        assert sum(u.weights for u in units_of(config)) == parameters_bytes(config)
    # 8.03B parameters in bf16; an MoE layer holds its experts.
    assert sum(u.weights for u in units_of(LLAMA_8B)) == pytest.approx(16.06e9, rel=0.01)
    moe = {u.module: u.weights for u in units_of(SMALL_MOE)}
    assert moe["model.layers.1"] > 2 * moe["model.layers.0"]


def test_one_gpu_holds_an_8b_target_next_to_its_draft():
    devices = gpus(1, 80)
    result = plan("auto", units_of(LLAMA_8B), devices, draft_of(LLAMA_8B), world=1)
    assert result.placement == "replicated" and len(result.shares) == 1
    check_plan(result, LLAMA_8B, devices)
    assert result.describe()[0].startswith("target placement: replicated (the target (14.96 GiB) fits cuda:0")
    assert result.describe()[1].startswith(
        "  device 0 (cuda:0): layers 0-31, embed_tokens, norm, rotary_emb,"
    )
    # Every DDP rank checks its own GPU the same way.
    assert (
        plan("replicated", units_of(LLAMA_8B), devices, draft_of(LLAMA_8B), world=8).placement == "replicated"
    )


def test_a_target_one_gpu_cannot_hold_is_sharded_over_several():
    devices = gpus(2, 20)
    draft = draft_of(LLAMA_8B)
    with pytest.raises(
        PlacementError, match=r"^replicated: the target \(14.96 GiB of weights\) and the draft"
    ):
        plan("replicated", units_of(LLAMA_8B), devices, draft, world=1)
    result = plan("auto", units_of(LLAMA_8B), devices, draft, world=1)
    assert result.placement == "sharded" and len(result.shares) == 2
    check_plan(result, LLAMA_8B, devices)
    first, second = result.shares
    # The draft (10.91 GiB) takes GPU 0 with the first layers; the two GPUs hold about as much.
    assert first.draft > 0 and first.layers == [0, 1, 2, 3] and second.layers == list(range(4, 32))
    assert abs(first.planned - second.planned) < 0.05 * first.planned
    assert result.reason.startswith("the target (14.96 GiB) does not fit one device next to the draft")
    # The manifest's record: layers and bytes per GPU.
    record = result.as_dict()
    assert [d["device"] for d in record["devices"]] == ["cuda:0", "cuda:1"]
    assert [d["layers"] for d in record["devices"]] == [first.layers, second.layers]
    assert sum(d["weight_bytes"] for d in record["devices"]) == parameters_bytes(LLAMA_8B)


def test_a_70b_target_is_spread_evenly_over_four_gpus():
    devices = gpus(4, 80)
    result = plan("sharded", units_of(LLAMA_70B), devices, draft_of(LLAMA_70B), world=1)
    check_plan(result, LLAMA_70B, devices)
    assert len(result.shares) == 4
    # The draft (30.57 GiB: 1.4B trainable parameters with AdamW, 2048 positions) shares GPU 0 with
    # the first layers; the layers are evened out, not GPU 1 filled first, so every GPU keeps room
    # for transient tensors.
    assert result.shares[0].layers == [0, 1, 2, 3, 4]
    planned = [share.planned for share in result.shares]
    assert max(planned) - min(planned) < 0.15 * max(planned)
    assert max(share.planned for share in result.shares) < 0.75 * devices[0].usable


def test_gpus_of_different_free_memory_get_different_shares():
    devices = [Device("cuda:0", 80 * GiB), Device("cuda:1", 48 * GiB), Device("cuda:2", 80 * GiB)]
    result = plan("sharded", units_of(LLAMA_70B), devices, draft_of(LLAMA_70B), world=1)
    check_plan(result, LLAMA_70B, devices)
    assert result.shares[1].planned < result.shares[0].planned


def test_a_mixture_of_experts_target_is_sharded_by_whole_layers():
    devices = gpus(2, 24)
    result = plan("auto", units_of(SMALL_MOE), devices, draft_of(SMALL_MOE), world=1)
    assert result.placement == "sharded"
    check_plan(result, SMALL_MOE, devices)


def test_too_little_memory_is_refused_up_front_with_the_numbers():
    devices = gpus(2, 48)
    with pytest.raises(PlacementError) as refused:
        plan("auto", units_of(LLAMA_70B), devices, draft_of(LLAMA_70B), world=1)
    message = str(refused.value)
    assert message.startswith("the target needs 131.42 GiB of weights, ")
    assert (
        "but the 2 device(s) have 91.20 GiB usable together (cuda:0 48.00 GiB free, cuda:1 48.00 GiB free; "
        in message
    )
    assert f"{HEADROOM:.0%} kept as headroom; largest module lm_head " in message
    assert "\n" not in message


def test_sharded_is_one_process():
    with pytest.raises(
        PlacementError, match=r"--target-placement sharded runs in one process .* drop --nproc"
    ):
        plan("sharded", units_of(LLAMA_8B), gpus(8, 80), draft_of(LLAMA_8B), world=8)
    # auto under DDP can only replicate: a target one GPU cannot hold is refused, saying what would work.
    with pytest.raises(
        PlacementError,
        match=r"^auto with several processes \(replicated\): .* use --target-placement sharded",
    ):
        plan("auto", units_of(LLAMA_70B), gpus(8, 80), draft_of(LLAMA_70B), world=8)


def test_offline_trains_beside_the_lm_head_only_and_runs_the_target_where_it_fits():
    devices = gpus(4, 80)
    result = plan("offline", units_of(LLAMA_70B), devices, draft_of(LLAMA_70B), world=1)
    assert result.placement == "offline"
    assert [share.modules for share in result.shares] == [["lm_head"]]
    assert result.features.placement == "sharded"  # one GPU cannot hold the target alone either
    check_plan_of_target_alone = [layer for share in result.features.shares for layer in share.layers]
    assert check_plan_of_target_alone == list(range(80))
    assert all(share.draft == 0 for share in result.features.shares)
    lines = result.describe()
    assert lines[1].startswith("  device 0 (cuda:0): lm_head, the draft; planned ")
    assert [line.split(":")[0] for line in lines[2:]] == ["features pass"] * len(result.features.shares)
    # An 8B target runs its features pass on one GPU.
    assert (
        plan("offline", units_of(LLAMA_8B), gpus(2, 32), draft_of(LLAMA_8B), 1).features.placement
        == "replicated"
    )
    assert result.as_dict()["features_pass"]["placement"] == "sharded"


def test_without_gpus_auto_says_what_it_picked_and_why():
    result = plan("auto", units_of(LLAMA_8B), [Device("cpu", 200 * GiB)], draft_of(LLAMA_8B), world=1)
    assert result.placement == "replicated"
    assert "fits this process's memory (no GPU) next to the draft" in result.describe()[0]


SMALL_TARGET = LlamaConfig(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
)


def training_step(length: int, steps: int, recompute: bool, batch: int = 1, loss_chunk: int = 512):
    """The draft, and a function running its loss's forward (``backward=False``) or also the backward."""
    draft = Eagle3Draft(draft_config(SMALL_TARGET, 256, [1, 3, 4]))
    ids = torch.randint(0, 1024, (batch, length))
    inputs = TargetBatch(
        torch.randn(batch, length, 3 * 128),
        torch.randn(batch, length, 256),
        torch.ones(batch, length, dtype=torch.bool),
    )
    module = DraftLoss(draft, steps, 0.8, loss_chunk, recompute)

    def run(backward: bool):
        loss, _ = module(ids, ids >= 0, inputs)
        if backward:
            loss.backward()
        return loss

    return draft, run


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "kept"])
@pytest.mark.parametrize(("length", "steps"), [(512, 3), (2048, 7), (16384, 2)])
def test_the_draft_estimate_is_within_a_fifth_of_what_the_allocator_holds_for_the_backward(
    length, steps, recompute
):
    """The kept activations of ``draft_activations`` against a measurement: the bytes the CPU
    allocator holds once one training step's forward has run (fp32), which are what autograd keeps
    for the backward, checkpointed inputs included."""
    draft, run = training_step(length, steps, recompute)
    held: list = []
    measured, _ = allocator_bytes(lambda: held.append(run(backward=False)))
    kept, _ = draft_activations(draft.config, length, length, steps, 512, recompute)
    assert measured <= kept <= 1.2 * measured


def test_a_row_twice_as_long_takes_at_most_2_1_times_the_memory():
    """A training step's peak (forward and backward) at 2T against T: linear, no T x T term (the
    attention this replaced kept 2 x 8 heads x T x T x 6 bytes here: 1.5 GiB at 8192)."""
    peaks = []
    for length in (4096, 8192):
        _, run = training_step(length, 2, recompute=True)
        peaks.append(allocator_bytes(lambda run=run: run(backward=True))[1])
    assert peaks[1] <= 2.1 * peaks[0]


def test_a_tied_lm_head_goes_with_the_embedding_and_offline_holds_its_copy():
    tied = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    units = units_of(tied)
    assert [u.module for u in units[:3]] == ["model.embed_tokens", "lm_head", "model.layers.0"]
    assert sum(u.weights for u in units) == parameters_bytes(tied)  # the shared weight counted once
    result = plan("offline", units, gpus(1, 80), draft_of(tied), world=1)
    assert result.shares[0].weights == units[0].weights  # training holds the lm_head as its own tensor


@pytest.mark.parametrize(("rows", "length"), [(1, 2048), (16, 128)], ids=["one long row", "many short rows"])
def test_one_long_row_and_many_short_ones_both_fit_a_token_budgets_plan(rows, length):
    """The plan of a 2048-token budget holds one row of 2048 and sixteen rows of 128 alike: the
    loss and the attention chunk over the batch's tokens, not over each row."""
    draft, run = training_step(length, 3, recompute=True, batch=rows, loss_chunk=256)
    _, peak = allocator_bytes(lambda: run(backward=True))
    kept, transient = draft_activations(draft.config, 2048, 2048, 3, 256, True)
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert peak <= kept + transient + 4 * trained  # the gradients are made in the step
