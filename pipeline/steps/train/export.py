"""The draft as a Hugging Face folder SGLang serves as an EAGLE-3 draft, and back.

``config.json``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``target_hidden_size`` and the feature layers under
``eagle_config.eagle_aux_hidden_state_layer_ids``. ``model.safetensors``: ``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight`` and the buffers ``d2t`` (int64) and
``t2d`` (bool). The input embedding is left out: the server shares the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from pipeline.run.manifest import atomic_path
from pipeline.steps.train.model import Eagle3Draft

WEIGHTS = "model.safetensors"


def exported_state(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.startswith(("embed_tokens.", "rotary.")):
            continue
        state[name] = tensor.detach().to("cpu").contiguous()
        if tensor.is_floating_point():
            state[name] = state[name].to(dtype)
    return state


def export_draft(draft: Eagle3Draft, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the folder atomically (temp name, then rename)."""
    config = draft.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(exported_state(draft, dtype), tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def load_draft(folder: Path, target_embedding: torch.Tensor) -> Eagle3Draft:
    """An exported draft, with the target's input embedding put back."""
    raw = json.loads((folder / "config.json").read_text())
    config = LlamaConfig(**raw)
    draft = Eagle3Draft(config)
    state = load_file(folder / WEIGHTS)
    missing, unexpected = draft.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
    )
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"{folder}: unexpected keys {unexpected}, missing {missing}")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_embedding.float())
    return draft.eval()
