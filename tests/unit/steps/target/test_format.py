"""A target's format is decided once (pipeline/steps/target/format.py): each of the tests' targets
gets its holding, bytes per weight, prefix and loader from one value, which the planner, the loader
and the train worker read instead of deciding again; how a target is held is named in the target
package only."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from benchmarks.placement_arithmetic import KIMI_K25_RELEASE
from eyrie_testing import REPO
from pipeline.embedded.tiny import ensure_tiny_target
from pipeline.steps.target import load as target_load
from pipeline.steps.target import target_config
from pipeline.steps.target.format import WRAPPED_PREFIX, Loader, target_format
from pipeline.steps.target.holding import Holding
from pipeline.steps.train import loop, placement
from pipeline.steps.train.loop import TrainConfig

GLM5_NVFP4 = REPO / "tests" / "fixtures" / "glm5_nvfp4"
PACKAGE = REPO / "pipeline"
TARGET_PACKAGE = PACKAGE / "steps" / "target"
BLACKWELL = (12, 0)


def test_a_dense_target_is_its_own_language_model_loaded_by_transformers():
    fmt = target_format(target_config(ensure_tiny_target(), trust_remote_code=False))
    assert (fmt.holding, fmt.loader, fmt.prefix, fmt.quantization) == (
        Holding.DENSE,
        Loader.TRANSFORMERS,
        "",
        {},
    )
    assert fmt.text is fmt.config and not fmt.wrapped
    assert (fmt.bytes_per_weight, fmt.refused, fmt.unreadable, fmt.sglang_flags) == (None, None, None, [])


def test_kimi_k25_is_a_wrapper_whose_int4_experts_are_held_packed_by_eyrie():
    pytest.importorskip("compressed_tensors", reason="the `quantized` extra is not installed")
    config = AutoConfig.from_pretrained(KIMI_K25_RELEASE)
    fmt = target_format(config)
    assert fmt.wrapped and fmt.text is config.text_config and fmt.prefix == WRAPPED_PREFIX
    assert (fmt.holding, fmt.loader, fmt.bytes_per_weight) == (Holding.PACKED, Loader.EYRIE, None)
    assert fmt.quantization["format"] == "pack-quantized" and fmt.refused is None
    # Dequantized on purpose it is dense, and still eyrie's to read: the wrapper's language model.
    dense = target_format(config, dequantize=True)
    assert (dense.holding, dense.loader) == (Holding.DENSE, Loader.EYRIE)


def test_glm5_nvfp4_is_planned_as_stored_on_blackwell_never_loaded_and_served_by_sglang():
    config = AutoConfig.from_pretrained(GLM5_NVFP4)
    fmt = target_format(config, device_type="cuda", capability=BLACKWELL)
    assert (fmt.holding, fmt.bytes_per_weight, fmt.prefix) == (Holding.STORED, 0.5 + 1 / 16, "")
    assert fmt.ignore and "lm_head" in fmt.ignore
    assert fmt.sglang_flags == ["--quantization", "modelopt_fp4"]
    assert fmt.unreadable is not None and "--quantization modelopt_fp4" in fmt.unreadable
    elsewhere = target_format(config, device_type="cpu")
    assert elsewhere.holding is None and "'NVFP4 (modelopt)'" in elsewhere.refused.reason
    assert "dequantized it would need 1.00 KiB" in str(elsewhere.refused.error(1024))


def test_a_wrapper_stored_in_fp8_is_refused_without_a_dense_size():
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    text = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    text.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    fmt = target_format(Kimi_K25Config(text_config=copy.deepcopy(text).to_dict()), device_type="cuda")
    assert fmt.holding is None and "vision-language wrapper" in fmt.refused.reason
    assert "dequantized" not in str(fmt.refused.error(1024))


def _counted(monkeypatch, name: str, modules) -> list[str]:
    """Calls of ``name`` through any of ``modules``' own references to it."""
    calls: list[str] = []
    for module in modules:
        original = getattr(module, name)

        def counting(*args, _original=original, _module=module.__name__, **kwargs):
            calls.append(_module)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("where", ["replicated", "offline"])
def test_the_worker_decides_the_format_once_and_builds_the_target_on_meta_once(tmp_path, monkeypatch, where):
    target = ensure_tiny_target()
    rows = [
        torch.randint(2, 200, (24,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)
    ]
    (tmp_path / "data").mkdir()
    pq.write_table(
        pa.table({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * 16] * len(rows)}),
        tmp_path / "data" / "shard-00000.parquet",
    )
    cfg = TrainConfig(
        data=tmp_path / "data",
        target=target,
        out_dir=tmp_path / "out",
        target_placement=where,
        draft_vocab_size=64,
        ttt_steps=2,
        batch_size=2,
        max_steps=1,
        threads=1,
        heldout_fraction=0.25,
    )
    decided = _counted(monkeypatch, "target_format", (loop, placement, target_load))
    built = _counted(monkeypatch, "meta_target", (loop, placement, target_load))
    result = loop.build(cfg, 1, None, lambda line: None)
    assert decided == [loop.__name__]  # once, by the worker; the planner and the loader read it
    # The plan's build; offline, the lm_head's reader builds its own (the features pass took the plan's).
    assert built == [loop.__name__] + ([target_load.__name__] if where == "offline" else [])
    assert result.setup.format.holding is Holding.DENSE
    assert result.setup.plan.holding is Holding.DENSE and result.setup.meta is None


HOLDINGS = {member.value for member in Holding}


def _compared_holding_strings(path: Path, root: Path = REPO) -> list[str]:
    """``X == "packed"`` and the like: a holding named as text in a comparison."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            texts = [n.value for n in (node.left, *node.comparators) if isinstance(n, ast.Constant)]
            found += [f"{path.relative_to(root)}:{node.lineno}: {t!r}" for t in texts if t in HOLDINGS]
    return found


def test_how_a_target_is_held_is_decided_in_the_target_package_only():
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if TARGET_PACKAGE not in p.parents]
    assert [line for path in outside for line in _compared_holding_strings(path)] == []
    # The quantization config is read by the format alone: no other module asks for its method.
    asking = [str(p.relative_to(REPO)) for p in outside if "quant_method" in p.read_text(encoding="utf-8")]
    assert asking == []


def test_the_check_sees_a_holding_compared_as_text(tmp_path):
    (tmp_path / "planner.py").write_text('def f(units):\n    return units.holding == "stored"\n')
    assert _compared_holding_strings(tmp_path / "planner.py", tmp_path) == ["planner.py:2: 'stored'"]
