"""nybble's ops, one folder each (``matmul/``, ``ragged_matmul/``): the public function with its argument
rules and ``implementation=`` (``api.py``), the float64 reference (``reference.py``) and the XLA path
(``xla.py``). The other backends (``nybble.kernels.mosaic_gpu``, ...) plug in through
``nybble.kernels.backends``; ``xla_backend.py`` plugs in the ops' XLA paths."""
