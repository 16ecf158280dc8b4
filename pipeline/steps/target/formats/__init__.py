"""The quantization formats a target may be stored in, one class a file, each registered in
:data:`pipeline.steps.target.format.FORMATS`: how it is held on a device, whether eyrie reads its
weights, what SGLang serves it with."""
