"""The target model, as every step that needs it reads it: named, checked, its format decided once,
built on the meta device for the plan, loaded.

- ``load.py``: the target by name (a hub id, a folder, a GGUF file), its config, tokenizer and
  weights; what the steps import, also from here.
- ``format.py``: :class:`~pipeline.steps.target.format.TargetFormat`, decided once from the config:
  the language model's config and prefix, the quantization, how the weights are held and at how
  many bytes a weight, which loader reads them, what SGLang is told; ``holding.py`` its words.
- ``formats/``: the quantization formats, one class a file, registered in ``format.py``.
- ``meta.py``: the language model on the meta device, held as its format says: what the planner
  sizes and the loader fills.
- ``quantized.py``: packed weights (compressed-tensors), and eyrie's reader of a checkpoint.
- ``vision_language.py``: a vision-language wrapper's language model (Kimi-K2.5).
- ``gguf.py``: a GGUF file converted once into a model folder.

Light on purpose (torch and transformers are imported where they are used): ``eyrie --help``
imports it.
"""

from pipeline.steps.target.load import (
    MODEL_FILES,
    REMOTE_CODE_FLAG,
    TOKENIZER_FILES,
    TargetError,
    attention_for,
    check_target,
    check_tokenizer,
    is_local,
    load_head,
    load_model,
    load_tokenizer,
    model_folder,
    resolved,
    target_config,
    use_attention,
    weights_key,
)

__all__ = [
    "MODEL_FILES",
    "REMOTE_CODE_FLAG",
    "TOKENIZER_FILES",
    "TargetError",
    "attention_for",
    "check_target",
    "check_tokenizer",
    "is_local",
    "load_head",
    "load_model",
    "load_tokenizer",
    "model_folder",
    "resolved",
    "target_config",
    "use_attention",
    "weights_key",
]
