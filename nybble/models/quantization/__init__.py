"""Quantization passes over whole models: the method configs (``methods``), per-layer rules (``rules``),
the plan and report (``quant_plan``), round to nearest (``adapter``), GPTQ (``calibrate``), AutoRound
(``autoround``) and end-to-end scale tuning (``tune``)."""
