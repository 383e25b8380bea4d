"""nybble throughput benchmarks: int4 weight-only GEMM against its peers, with measured ceilings.

Run ``python -m bench`` from the repository root (``--help`` for options). On a GPU it times every nybble
implementation that can run, XLA's bf16 dot, XLA's own int4 path, torch's tinygemm and tokamax side by side;
without one it times the XLA paths on the CPU at small shapes plus the host-side packing and quantization.
"""
