"""``x @ dequantize(qw)`` for one weight: ``api.py`` (``nybble.kernels.matmul``), ``reference.py`` (float64,
numpy only), ``xla.py`` (the XLA path)."""
