"""Model adapters: swap Flax dense layers for int4 ones, a Llama in NNX, SmolLM2, perplexity, generation.

    model, tokenizer = nybble.models.smollm2.load()
    model = nybble.models.quantize(model, group_size=128)       # nnx.Linear -> QLinear, in place
    ppl = nybble.models.perplexity(model, tokenizer.encode(nybble.models.eval_text()).ids)

Needs the ``models`` extra (flax, safetensors, gguf, tokenizers): ``pip install ".[models]"`` in a clone.
"""

try:  # one clear error naming the extra, before any module of the package needs flax
    import flax  # noqa: F401
except ModuleNotFoundError:
    from nybble.extras import missing_extra_message

    raise ModuleNotFoundError(missing_extra_message("flax", "nybble.models"), name="flax") from None

from nybble.models.definitions.fuse import fuse_projections, unfuse_projections
from nybble.models.definitions.layers import QDense, QLinear, QuantizedParam, dense
from nybble.models.definitions.llama import KVCache, Llama, LlamaConfig, set_decode_attention
from nybble.models.definitions.moe import MoE, MoEConfig, QExperts, set_decode_routing
from nybble.models.evaluate.measure import generate, negative_log_likelihood, perplexity
from nybble.models.evaluate.text import eval_text
from nybble.models.io import smollm2  # `models.smollm2.load()` works after `from nybble import models`
from nybble.models.io.hf.pretrained import from_pretrained, load_tokenizer
from nybble.models.io.hf.save import save_pretrained
from nybble.models.io.serialization import load_model, save_model
from nybble.models.placement.shard import DEFAULT_SHARD_RULES, ShardReport, ShardRule, shard
from nybble.models.quantization.adapter import quantize, quantize_params
from nybble.models.quantization.methods import GPTQ, RTN, AutoRound
from nybble.models.quantization.quant_plan import LayerReport, QuantizationReport, plan_quantization
from nybble.models.quantization.rules import DEFAULT_RULES, INHERIT, QuantRule

__all__ = [
    "DEFAULT_RULES",
    "DEFAULT_SHARD_RULES",
    "GPTQ",
    "INHERIT",
    "RTN",
    "AutoRound",
    "KVCache",
    "LayerReport",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "QDense",
    "QExperts",
    "QLinear",
    "QuantRule",
    "QuantizationReport",
    "QuantizedParam",
    "ShardReport",
    "ShardRule",
    "dense",
    "eval_text",
    "from_pretrained",
    "fuse_projections",
    "generate",
    "load_model",
    "load_tokenizer",
    "negative_log_likelihood",
    "perplexity",
    "plan_quantization",
    "quantize",
    "quantize_params",
    "save_model",
    "save_pretrained",
    "set_decode_attention",
    "set_decode_routing",
    "shard",
    "smollm2",
    "unfuse_projections",
]
