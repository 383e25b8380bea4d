"""Evaluating models: perplexity, log-likelihood and generation (``measure``), the committed evaluation
text (``text``) and the named models of the CLI and benchmarks (``zoo``)."""
