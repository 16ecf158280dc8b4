"""A target given as a GGUF file (``--target FILE.gguf``, or a folder that holds one), converted
once into a model folder that every step reads as it reads any other.

transformers reads GGUF through the ``gguf`` package, dequantizing each tensor. The model it loads
refuses ``save_pretrained`` ("quantized with gguf … not serializable"), so its weights are moved,
strictly, into a fresh model of the same config (without the GGUF ``quantization_config``), which
saves. They are saved in float32: a dequantized weight is an fp16 scale times a small integer plus
an fp16 offset, which float32 holds exactly and bfloat16's 8-bit mantissa does not, so the folder
computes what the GGUF computes; a step that runs in bfloat16 casts on loading, as for any folder.
The tokenizer and its chat template are saved beside the weights.

The folder sits under eyrie's cache root, named by the file's sha256: a copy of the same file (a
reinstalled wheel rewrites modification times) finds the same conversion, and a file rewritten in
place with its size and time kept is never taken for the old one. Hashing reads the file once per
process, at disk speed, small beside loading it. The folder is written under a temporary name and
renamed whole, so a killed conversion leaves nothing that looks complete; its ``manifest.json``
records the conversion (the GGUF file, its sha256, its tensors' quantization types, the saved dtype).
"""

from __future__ import annotations

import fcntl
import functools
import sys
from collections import Counter
from pathlib import Path

from pipeline.contract.atomic import atomic_path
from pipeline.contract.step import MANIFEST_NAME, cache_root, sha256_file, write_manifest

GGUF_SUFFIX = ".gguf"
SAVED_DTYPE = "float32"
CONVERSION = "gguf-conversion"
"""The step name the converted folder's manifest gives: no pipeline step wrote it."""


class GGUFError(ValueError):
    """The GGUF file cannot be converted; the message is one line naming the file and why."""


def gguf_file(target: str | Path) -> Path | None:
    """The GGUF file ``target`` names: itself, or the one GGUF file in a folder that is not
    already a model folder (a hub repository may ship GGUF files beside its safetensors)."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == GGUF_SUFFIX)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(f"holds {len(found)} GGUF files ({names}): name the one to use")
    return found[0] if found else None


@functools.cache
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    """The file's sha256, remembered while its size and time stay (each step resolves its target
    several times: checked, then its config, then its weights)."""
    return sha256_file(path)


def converted(target: str | Path) -> str | Path:
    """``target`` itself, unless it names a GGUF file: then the cached model folder converted from
    it (converting it first, once, under a lock so that parallel steps wait instead of racing)."""
    path = gguf_file(target)
    if path is None:
        return target
    path = path.resolve()
    stat = path.stat()
    digest = _digest(path, stat.st_size, stat.st_mtime_ns)
    folder = cache_root() / "gguf" / digest[:16]  # not the file's name: a copy is the same target
    if (folder / MANIFEST_NAME).is_file():
        return folder
    types = quantization_types(path)  # before the lock: a refused file leaves nothing in the cache
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / MANIFEST_NAME).is_file():
            _convert(path, folder, digest, types)
    return folder


def quantization_types(path: Path) -> Counter[str]:
    """How many of the file's tensors each quantization type stores; a GGUFError naming the first
    type transformers cannot read: it dequantizes through ``gguf.quants.dequantize``, asked here
    on one zero block of each type."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader
    from gguf.quants import dequantize

    try:
        tensors = GGUFReader(path).tensors
    except (OSError, ValueError) as exc:
        raise GGUFError(f"not a GGUF file transformers can read ({str(exc).strip()[:200]})") from None
    types = Counter(tensor.tensor_type for tensor in tensors)
    for kind in types:
        block = np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8)
        try:
            dequantize(block, kind)
        except NotImplementedError:
            first = next(t.name for t in tensors if t.tensor_type == kind)
            raise GGUFError(
                f"tensor {first} is stored as {kind.name}, a GGUF quantization type transformers "
                "cannot read; convert the file to one it reads (e.g. Q8_0, Q4_K or F16)"
            ) from None
    return Counter({kind.name: count for kind, count in types.items()})


def _convert(path: Path, folder: Path, digest: str, types: Counter[str]) -> None:
    print(f"converting {path} once into {folder} (weights in {SAVED_DTYPE})", file=sys.stderr, flush=True)
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        architecture = _save(path, tmp)
        write_manifest(
            tmp,
            sorted(p.name for p in tmp.iterdir()),
            step=CONVERSION,
            fingerprint=digest,
            stats={
                "gguf": {"file": str(path), "bytes": path.stat().st_size, "sha256": digest},
                "quantization_types": dict(sorted(types.items())),
                "architecture": architecture,
                "saved_dtype": SAVED_DTYPE,
            },
        )


def _save(path: Path, out: Path) -> str:
    """The GGUF's tokenizer and dequantized weights saved into ``out``; the model's class name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name, dtype = str(path.parent), path.name, getattr(torch, SAVED_DTYPE)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=dtype)
    except (OSError, ValueError, ImportError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GGUFError(f"transformers cannot load it: {first}") from None
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)  # what makes save_pretrained refuse the model
    config = type(loaded.config).from_dict(settings)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return type(model).__name__
