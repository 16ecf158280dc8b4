"""The EAGLE-3 draft as train writes it and accept reads it: the model, its SGLang/SpecForge
folder, and the chain speculative decoding both measure it with."""
