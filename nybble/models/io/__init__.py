"""Reading and writing models: nybble's own checkpoints (``serialization``), Hugging Face directories
(``hf``), GGUF files (``gguf_file``, ``gguf_llama``) and the packaged SmolLM2 (``smollm2``)."""
