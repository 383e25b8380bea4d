"""Hugging Face checkpoint directories: files (``files``), config and names (``config``, ``names``)."""
