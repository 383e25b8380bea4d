"""The grouped product of a mixture of experts: ``api.py`` (``nybble.kernels.ragged_matmul``),
``reference.py`` (float64, numpy only), ``xla.py`` (the XLA path)."""
