"""Decode tokens/s of whole models, predicted from one compiled decode step (no GPU needed).

``python -m bench.decode --models llama3-8b --gpu h200 --batch 1 8 64 --context 4096 --out DIR`` compiles
one decode step (a new token per sequence over a KV cache of ``--context`` tokens) of each model for the
named GPU on a deviceless topology (the X-ray's toolchain, ``bench.kernel_xray``), once with bf16 weights
and once int4 g128 as ``nybble.models.quantize`` makes them, from abstract weights. It counts the step's
launches and bytes by op family and predicts tokens/s with a static model (``bench.decode.predict``).
A prediction, never a timing.

Modules: ``models`` (the configurations), ``program`` (abstract model and the step), ``worker`` (the
compiling process), ``count`` (launches by family, command buffers, layer extrapolation), ``predict``
(time per launch, the HBM limit), ``report`` (decode.json and decode.md).
"""
