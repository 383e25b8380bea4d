"""The portable W4A16 kernel: Pallas on the Triton backend, for every NVIDIA GPU where the Mosaic GPU
(Hopper) kernel does not run: Ampere, Ada, Blackwell (sm_100 until its own kernel, sm_120), and Hopper
with f32 activations. It reads the ``planes_nk_int4`` layout (``nybble.packing.planes``).

Modules: ``config`` (TuningConfig and its heuristics), ``dequant`` (the register work, byte by byte),
``dense`` (the dense kernel), ``grouped`` (the mixture-of-experts kernel), ``backend`` (the functions the
dispatcher calls)."""
