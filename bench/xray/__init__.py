"""``python -m bench.xray``: nybble's kernels compiled for an H200 (sm_90a) on a CPU, and what they would run.

For each named shape, M and group setting: the config the heuristics pick, ptxas' registers and spills,
the SMEM, the main loop's SASS (instructions, mix, stalls, **instructions per weight per thread**), the
bytes one call moves and the launches it costs, beside XLA's bf16 dot and XLA's int4 path compiled the
same way; then a static model (issue-, HBM- and tensor-core-bound times). See bench/README.md.
"""
