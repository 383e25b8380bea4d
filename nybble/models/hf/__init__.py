"""Hugging Face checkpoint directories: config.json mapping (``config``), tensor names (``names``)."""
