"""The target model, named by a Hugging Face hub id, a local folder or a GGUF file (converted once
into a cached folder: :func:`resolved`), loaded as its format says (:mod:`pipeline.steps.target.format`).

The same name serves every step that needs the target (tokenize: its tokenizer and chat
template; train and accept: its weights). A target that ships its own code (``auto_map``
in its config, as Kimi-K2 does) loads only with ``trust_remote_code``; without it the
error is one line naming ``--trust-remote-code``. A checkpoint stored quantized (a
``quantization_config`` such as compressed-tensors INT4 experts) is held as its format says,
read by compressed-tensors' own functions (installed with the ``quantized`` extra) or transformers'.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from pipeline.steps.target.format import Loader, TargetFormat, target_format
from pipeline.steps.target.holding import HeldFormatError
from pipeline.steps.target.meta import MetaTarget, meta_target, quiet_transformers

REMOTE_CODE_FLAG = "--trust-remote-code"
# A hub id: NAME or OWNER/NAME (letters, digits, - _ .), as the hub accepts them.
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class TargetError(ValueError):
    """The target cannot be used; the message is one line naming it and the fix."""


def is_local(target: str | Path) -> bool:
    return Path(target).exists() or str(target).startswith((".", "/", "~"))


def resolved(target: str | Path, option: str) -> str | Path:
    """The target as the steps read it: itself, or for a GGUF file (or a folder holding one) the
    model folder it is converted into once (:mod:`pipeline.steps.target.gguf`). Every function here
    that takes a target starts with this, so each step takes a GGUF file without code of its own."""
    from pipeline.steps.target.gguf import GGUFError, converted

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


def target_config(target: str | Path, *, trust_remote_code: bool, option: str = "--target"):
    """The target's config alone (seconds, even for a hub id): what can be checked before the weights."""
    from transformers import AutoConfig

    target = resolved(target, option)
    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise TargetError(_reason(exc, target, option)) from None


def load_model(
    target: str | Path,
    *,
    dtype: Any,
    trust_remote_code: bool,
    option: str = "--target",
    device_map: dict[str, str] | None = None,
    dequantize: bool = False,
    meta: MetaTarget | None = None,
):
    """The target's causal language model (weights from its folder, or the hub's cache).

    With a ``device_map`` each module loads straight onto its device (several devices are joined by
    accelerate's hooks, which move activations between them). A quantized target is held as stored
    (packed experts stay packed) unless ``dequantize``; a vision-language wrapper gives its language
    model, and its vision tower is never loaded. ``meta``: the target already built on the meta
    device for its plan (:func:`pipeline.steps.target.meta.meta_target`), filled here instead of built
    again; its format, decided with it, stands for ``dequantize`` and the device.
    """
    from transformers import AutoModelForCausalLM

    from pipeline.steps.target.quantized import load_held

    target = resolved(target, option)
    devices = set((device_map or {}).values())
    device_type = "cuda" if any(str(d).startswith("cuda") for d in devices) else "cpu"
    try:
        if meta is None:
            config = target_config(target, trust_remote_code=trust_remote_code, option=option)
            fmt = target_format(config, device_type=device_type, dequantize=dequantize)
        else:
            fmt = meta.format
        fmt.check_readable()
        if meta is None and (fmt.loader is Loader.EYRIE or fmt.refused is not None):
            meta = meta_target(fmt, dtype, trust_remote_code=trust_remote_code)  # refused: with its size
        if fmt.loader is Loader.EYRIE:
            default = next(iter(devices), "cpu")
            model = load_held(
                meta.model, model_folder(target), fmt.prefix, dtype, device_map, fmt.quantization, default
            )
        else:
            # An explicit False: transformers then refuses custom code instead of asking on stdin.
            with quiet_transformers(), warnings.catch_warnings():
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


def load_head(target: str | Path, fmt: TargetFormat, dtype: Any, device: Any, *, trust_remote_code: bool):
    """(lm_head on ``device``, input embedding weight on the CPU) read by name from the checkpoint's
    safetensors files: what offline training needs of the target of format ``fmt``, without loading
    the rest."""
    import torch

    from pipeline.steps.target.quantized import Checkpoint

    model = meta_target(fmt, dtype, trust_remote_code=trust_remote_code).model
    names = {module: name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    wanted = {f"{names[head]}.{p}": p for p, _ in head.named_parameters()}
    tied = head.weight is embedding.weight
    stored = {f"{names[head]}.weight": f"{names[embedding]}.weight"} if tied else {}
    embedding_name = f"{names[embedding]}.weight"
    checkpoint = Checkpoint(model_folder(target))
    tensors = {}
    for name in [*wanted, embedding_name]:
        key = fmt.prefix + stored.get(name, name)
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
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        reason = refused if "trust_remote_code" in str(exc) else _reason(exc, target, option)
        raise TargetError(reason) from None
    if not trust_remote_code and tokenizer.init_kwargs.get("auto_map"):
        raise TargetError(refused)  # loaded without its class: a stand-in, not the target's tokenizer
    return tokenizer
