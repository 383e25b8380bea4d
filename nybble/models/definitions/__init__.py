"""Model definitions: the Llama family (``llama``), mixtures of experts (``moe``) and the int4 layers they
hold (``layers``). Nothing here imports the quantization passes, the readers and writers, placement or
evaluation: they all build on these."""
