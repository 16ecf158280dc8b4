"""The draft as a Hugging Face folder SGLang serves as an EAGLE-3 draft, and back.

``config.json``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``target_hidden_size`` and the feature layers under
``eagle_config.eagle_aux_hidden_state_layer_ids``. ``model.safetensors``: ``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight`` and the buffers ``d2t`` (int64) and
``t2d`` (bool). The input embedding is left out: the server shares the target's.
RoPE is written twice, as ``rope_parameters`` (transformers 5) and ``rope_scaling``
(transformers 4.x), so every SGLang build serves the draft with the target's scaling.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from pipeline.contract.atomic import atomic_path
from pipeline.steps.eagle3.model import Eagle3Draft, aux_layer_ids

WEIGHTS = "model.safetensors"
# Left out of the folder: the input embedding (the server shares the target's) and RoPE's tables.
_NOT_EXPORTED = ("embed_tokens.", "rotary.")


def exported_state(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.startswith(_NOT_EXPORTED):
            continue
        state[name] = tensor.detach().to("cpu").contiguous()
        if tensor.is_floating_point():
            state[name] = state[name].to(dtype)
    return state


def rope_scaling(rope_parameters: dict) -> dict | None:
    """transformers 4.x's ``rope_scaling`` (what SGLang builds pinned to it read) for 5.x's
    ``rope_parameters``: the scaling without ``rope_theta``, None for plain RoPE."""
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


def export_draft(
    draft: Eagle3Draft, out: Path, layer_ids: list[int], dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the folder atomically (temp name, then rename).

    ``layer_ids``: the target layers whose outputs the draft was trained on; the config must
    state the same, or SGLang would feed the draft other layers than it learned from.
    """
    stated = aux_layer_ids(draft.config)
    if stated != list(layer_ids):
        raise ValueError(
            f"the draft was trained on target layers {list(layer_ids)} but its config states {stated}: "
            "SGLang would capture the wrong layers"
        )
    config = draft.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["rope_scaling"] = rope_scaling(config["rope_parameters"])
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(exported_state(draft, dtype), tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def load_draft(folder: Path, target_embedding: torch.Tensor) -> Eagle3Draft:
    """An exported draft, loaded strictly: every tensor the class holds comes from the folder,
    except the input embedding, which is the target's (as SGLang shares it)."""
    raw = json.loads((folder / "config.json").read_text())
    config = LlamaConfig(**raw)
    draft = Eagle3Draft(config)
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(folder / WEIGHTS).items()}
    state["embed_tokens.weight"] = target_embedding.detach().float()
    try:
        draft.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # missing or unexpected keys, or a shape that is not the config's
        raise ValueError(f"{folder}: not a draft this class loads: {exc}".replace("\n", " ")) from None
    return draft.eval()


def check_draft(folder: Path, target=None) -> None:
    """The folder holds a draft this class loads strictly: every tensor of its class by name and
    shape, and nothing else (read from the safetensors header: no weight is loaded); with the
    target's config, a draft made for that target (its width and vocabulary). A ValueError says
    what differs: SGLang itself would skip an unknown tensor and leave a missing one random."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder}: no exported draft config ({exc})") from None
    missing = [k for k in ("draft_vocab_size", "target_hidden_size", "eagle_config") if k not in raw]
    if missing or "LlamaForCausalLMEagle3" not in raw.get("architectures", []):
        raise ValueError(
            f"{folder}/config.json is not an EAGLE-3 draft's (no {', '.join(missing) or 'architectures'})"
        )
    if target is not None:
        theirs = {"vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size}
        ours = {"vocab_size": raw.get("vocab_size"), "target_hidden_size": raw["target_hidden_size"]}
        if ours != theirs:
            raise ValueError(f"{folder} is a draft for another target: it has {ours}, the target {theirs}")
    with torch.device("meta"):
        draft = Eagle3Draft(LlamaConfig(**raw))
    expected = {k: tuple(v.shape) for k, v in draft.state_dict().items() if not k.startswith(_NOT_EXPORTED)}
    try:
        with safe_open(folder / WEIGHTS, framework="pt") as weights:
            found = {k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()}
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{folder / WEIGHTS}: cannot read it: {exc}") from None
    problems = [f"missing {k}" for k in sorted(expected.keys() - found.keys())]
    problems += [f"unexpected {k}" for k in sorted(found.keys() - expected.keys())]
    problems += [
        f"{k} is {list(found[k])}, its config makes {list(expected[k])}"
        for k in sorted(expected.keys() & found.keys())
        if found[k] != expected[k]
    ]
    if problems:
        raise ValueError(f"{folder / WEIGHTS} is not the draft its config describes: {'; '.join(problems)}")
