"""The target model, named by a Hugging Face hub id, a local folder or a GGUF file (converted once
into a cached folder: :func:`resolved`), loaded with transformers.

The same name serves every step that needs the target (tokenize: its tokenizer and chat
template; train and accept: its weights). A target that ships its own code (``auto_map``
in its config, as Kimi-K2 does) loads only with ``trust_remote_code``; without it the
error is one line naming ``--trust-remote-code``. A checkpoint stored quantized (a
``quantization_config`` such as compressed-tensors INT4 experts) loads through
transformers' quantizer for its format, installed with the ``quantized`` extra.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.steps.wrapper import language_config

REMOTE_CODE_FLAG = "--trust-remote-code"
# A hub id: NAME or OWNER/NAME (letters, digits, - _ .), as the hub accepts them.
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class TargetError(ValueError):
    """The target cannot be used; the message is one line naming it and the fix."""


def is_local(target: str | Path) -> bool:
    return Path(target).exists() or str(target).startswith((".", "/", "~"))


def resolved(target: str | Path, option: str) -> str | Path:
    """The target as the steps read it: itself, or for a GGUF file (or a folder holding one) the
    model folder it is converted into once (:mod:`pipeline.steps.gguf_target`). Every function here
    that takes a target starts with this, so each step takes a GGUF file without code of its own."""
    from pipeline.steps.gguf_target import GGUFError, converted

    try:
        return converted(target)
    except GGUFError as exc:
        raise TargetError(f"{option} {target}: {exc}") from None


def check_target(target: str | Path, option: str) -> None:
    """Before any work: a local target is a model folder; anything else must read as a hub id."""
    target = resolved(target, option)
    path = Path(target)
    if is_local(target):
        if not path.exists():
            raise TargetError(f"{option} {target} does not exist (run its step first, or give a hub id)")
        if not (path / "config.json").is_file():
            raise TargetError(f"{option} {target} is not a Hugging Face model folder (no config.json)")
    elif not _HUB_ID_RE.match(str(target)):
        raise TargetError(f"{option} {target!r} is neither a model folder nor a hub id (OWNER/NAME)")


# What a folder holds when it holds a tokenizer transformers can load (one is enough).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
)


def check_tokenizer(target: str | Path, option: str) -> None:
    """Before loading: a local tokenizer is a folder holding tokenizer files; anything else must
    read as a hub id (else transformers would call a missing folder a malformed hub id)."""
    target = resolved(target, option)
    path = Path(target).expanduser()
    if is_local(target):
        if not path.is_dir():
            raise TargetError(f"{option} {target}: no such folder (give the target's folder or a hub id)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            expected = ", ".join(TOKENIZER_FILES)
            raise TargetError(f"{option} {target}: no tokenizer files in it (expected one of {expected})")
    elif not _HUB_ID_RE.match(str(target)):
        raise TargetError(f"{option} {target!r} is neither a folder nor a hub id (OWNER/NAME)")


def _reason(exc: Exception, target: str | Path, option: str) -> str:
    text = str(exc)
    if "compressed_tensors" in text or "compressed-tensors" in text:
        return (
            f"{option} {target}: the checkpoint is stored in compressed-tensors format; "
            "install its quantizer: pip install 'eyrie[quantized]'"
        )
    if "trust_remote_code" in text:
        return (
            f"{option} {target}: the model ships its own code (auto_map in its config); "
            f"pass {REMOTE_CODE_FLAG} to run it, if you trust it"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{option} {target}: cannot load the model: {first}"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings while it resolves a target's classes (e.g. "a model of type X to
    instantiate a model of type ''" for custom code) would bury the one line that matters."""
    from transformers.utils import logging

    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


def target_config(target: str | Path, *, trust_remote_code: bool, option: str = "--target"):
    """The target's config alone (seconds, even for a hub id): what can be checked before the weights."""
    from transformers import AutoConfig

    target = resolved(target, option)
    try:
        with _quiet_transformers():
            return AutoConfig.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise TargetError(_reason(exc, target, option)) from None


@dataclass
class LanguageModel:
    """The target's language model with its parameters on the meta device, held as it will be loaded."""

    model: Any
    prefix: str
    """What the checkpoint's names carry before the model's own (``language_model.`` in a wrapper)."""
    left_out: int
    """Bytes of the wrapper's other modules (a vision tower and its projector): never loaded."""
    holding: Any
    """How its weights are held (:class:`pipeline.steps.quantized.Holding`)."""


def language_model(
    config: Any,
    dtype: Any,
    *,
    trust_remote_code: bool,
    device_type: str = "cpu",
    dequantize: bool = False,
    capability: tuple[int, int] | None = None,
) -> LanguageModel:
    """The target's causal language model on the meta device (buffers real), with its quantized
    modules held as stored (:mod:`pipeline.steps.quantized`) on ``device_type`` of compute
    ``capability`` (default: this process's GPU's) unless ``dequantize``.

    A wrapper's language model is its own remote code's ``language_model`` under
    ``--trust-remote-code``, else transformers' class for its ``text_config`` (for Kimi-K2.5:
    DeepSeek-V3); either way its names are the checkpoint's after ``language_model.``.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    from pipeline.steps.quantized import HeldFormatError, Holding, hold_packed, holding, quantization_of

    text = language_config(config)
    with init_empty_weights(include_buffers=False), _quiet_transformers():
        if text is config:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            prefix, left_out = "", 0
        else:
            loader = AutoModelForCausalLM if trust_remote_code else AutoModel
            wrapper = loader.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            inner = getattr(wrapper, "language_model", None)
            ships_lm = trust_remote_code and inner is not None and inner.get_output_embeddings() is not None
            model = inner if ships_lm else AutoModelForCausalLM.from_config(text, dtype=dtype)
            prefix = "language_model."
            left_out = sum(
                p.numel() * p.element_size()
                for name, p in wrapper.named_parameters()
                if "language_model" not in name and not name.startswith("lm_head")
            )
    model.tie_weights()  # the empty-weights context replaced the tied parameters with copies
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    stored = (
        holding(config, device_type, dense, capability)
        if text is not config or not dequantize
        else Holding("dense")
    )
    if stored.kind == "stored" and text is not config:
        # transformers runs FP8/MXFP4 as stored only through its own loading of the whole model;
        # eyrie's loader of a wrapper's language model reads only compressed-tensors INT weights.
        raise HeldFormatError(
            f"the target is a vision-language wrapper whose language model is stored as "
            f"{quantization_of(config).get('quant_method')!r}: eyrie loads a wrapper's language model "
            "itself and reads only compressed-tensors INT weights; use a checkpoint of the language "
            "model alone"
        )
    held = Holding("dense") if dequantize else stored
    if held.kind == "packed":
        scale = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        hold_packed(model, config, prefix, scale_dtype=scale)
    return LanguageModel(model.requires_grad_(False), prefix, left_out, held)


def load_model(
    target: str | Path,
    *,
    dtype: Any,
    trust_remote_code: bool,
    option: str = "--target",
    device_map: dict[str, str] | None = None,
    dequantize: bool = False,
):
    """The target's causal language model (weights from its folder, or the hub's cache).

    With a ``device_map`` each module loads straight onto its device (several devices are joined by
    accelerate's hooks, which move activations between them). A quantized target is held as stored
    (packed experts stay packed) unless ``dequantize``; a vision-language wrapper gives its language
    model, and its vision tower is never loaded.
    """
    from transformers import AutoModelForCausalLM

    from pipeline.steps.quantized import HeldFormatError, check_readable, load_held, quantization_of

    target = resolved(target, option)
    config = target_config(target, trust_remote_code=trust_remote_code, option=option)
    devices = set((device_map or {}).values())
    device_type = "cuda" if any(str(d).startswith("cuda") for d in devices) else "cpu"
    try:
        check_readable(config)
        lm = language_model(
            config, dtype, trust_remote_code=trust_remote_code, device_type=device_type, dequantize=dequantize
        )
        wrapped = language_config(config) is not config
        if wrapped or lm.holding.kind == "packed" or (dequantize and quantization_of(config)):
            default = next(iter(devices), "cpu")
            model = load_held(lm.model, model_folder(target), lm.prefix, dtype, device_map, config, default)
        else:
            # An explicit False: transformers then refuses custom code instead of asking on stdin.
            with _quiet_transformers(), warnings.catch_warnings():
                # "the quantization_config from the model will be used": what is asked for.
                warnings.filterwarnings("ignore", message=".*already has a `quantization_config`")
                model = AutoModelForCausalLM.from_pretrained(
                    str(target), dtype=dtype, trust_remote_code=trust_remote_code, device_map=device_map
                )
    except HeldFormatError as exc:
        raise TargetError(f"{option} {target}: {exc}") from None
    except (OSError, ValueError, ImportError) as exc:  # no model, weights unreadable, code refused
        raise TargetError(_reason(exc, target, option)) from None
    use_attention(model, attention_for(device_type, dtype))
    return model


def attention_for(device_type: str, dtype: Any) -> str:
    """The attention the target's forward should use: flash-attn's kernels where they run (a CUDA
    device, 16-bit weights, the ``flash_attn`` package installed, as the pipeline image has it on a
    GPU host), else PyTorch's scaled-dot-product attention."""
    import importlib.util

    import torch

    fast = device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return "flash_attention_2" if fast and importlib.util.find_spec("flash_attn") else "sdpa"


def use_attention(model: Any, attention: str) -> str:
    """Switch ``model`` to ``attention`` where its class supports it, else keep its own (a remote
    code's attention may know only its own); the attention in use, as the manifest records it."""
    if model.config._attn_implementation != attention:
        try:
            model.set_attn_implementation(attention)
        except (ValueError, ImportError):
            pass
    return model.config._attn_implementation


# What the steps read of a target by file: its config and its weights with their index (the
# tokenizer and any code it ships are fetched by transformers when they are loaded).
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


def model_folder(target: str | Path) -> Path:
    """The folder holding the target's files: its own, or the hub cache's snapshot of a hub id
    (fetched, when it is not there yet, for the files the steps read)."""
    target = resolved(target, "--target")
    if is_local(target):
        return Path(target)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(str(target), allow_patterns=list(MODEL_FILES)))
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise TargetError(_reason(exc, target, "--target")) from None


def weights_key(target: str | Path) -> dict[str, Any]:
    """What names the target's weights: a hub id's snapshot (the commit it was fetched at), or a
    folder's config and weight files (name, size, modification time)."""
    target = resolved(target, "--target")
    folder = model_folder(target)
    if not is_local(target):
        return {"hub": str(target), "revision": folder.name}
    files = sorted({f for pattern in MODEL_FILES for f in folder.glob(pattern) if f.is_file()})
    return {"files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]}


def load_head(target: str | Path, config: Any, dtype: Any, device: Any, *, trust_remote_code: bool):
    """(lm_head on ``device``, input embedding weight on the CPU) read by name from the checkpoint's
    safetensors files: what offline training needs of the target, without loading the rest."""
    import torch

    from pipeline.steps.quantized import Checkpoint

    lm = language_model(config, dtype, trust_remote_code=trust_remote_code)
    model = lm.model
    names = {module: name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    wanted = {f"{names[head]}.{p}": p for p, _ in head.named_parameters()}
    tied = head.weight is embedding.weight
    stored = {f"{names[head]}.weight": f"{names[embedding]}.weight"} if tied else {}
    embedding_name = f"{names[embedding]}.weight"
    checkpoint = Checkpoint(model_folder(target))
    tensors = {}
    for name in [*wanted, embedding_name]:
        key = lm.prefix + stored.get(name, name)
        if key not in checkpoint:
            raise TargetError(
                f"no tensor {key} in the safetensors files of {target}: offline training reads it"
            )
        tensors[name] = checkpoint.get(key).to(dtype)
    head = head.to_empty(device=device)
    with torch.no_grad():
        for name, param in wanted.items():
            head.get_parameter(param).copy_(tensors[name])
    return head, tensors[embedding_name]


def load_tokenizer(target: str | Path, *, trust_remote_code: bool, option: str = "--tokenizer"):
    """The target's own tokenizer (and chat template).

    A tokenizer that ships its own class (``auto_map`` in its tokenizer_config.json, as
    Kimi-K2.5's tiktoken one does) is refused without ``trust_remote_code``: that class alone
    splits text as the target does, and the fast tokenizer transformers would build in its place
    from the BPE file alone splits by a generic pattern (contractions, digits) instead.
    """
    from transformers import AutoTokenizer

    refused = (
        f"{option} {target}: the tokenizer ships its own code (auto_map in its tokenizer_config.json), "
        f"which alone tokenizes as the target does; pass {REMOTE_CODE_FLAG} to run it, if you trust it"
    )
    target = resolved(target, option)
    check_tokenizer(target, option)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        reason = refused if "trust_remote_code" in str(exc) else _reason(exc, target, option)
        raise TargetError(reason) from None
    if not trust_remote_code and tokenizer.init_kwargs.get("auto_map"):
        raise TargetError(refused)  # loaded without its class: a stand-in, not the target's tokenizer
    return tokenizer
