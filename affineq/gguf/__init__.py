"""GGUF in and out: llama.cpp's files as affineq tensors and models, and affineq models as GGUF files.

- `load_file(path)`: every tensor of a GGUF file; quantized ones as `AffineQuantizedTensor`s holding the file's
  codes and scales (`affineq.gguf.types` lists the types and how each is held exactly).
- `load_model(path)` / `load_tokenizer(path)`: a transformers model (Llama family, Qwen2, Mistral, Gemma 3)
  and its tokenizer from a GGUF file (`affineq.gguf.models`).
- `GGUFBlockConfig(ggml_type)` / `quantize_blocks(weight, ggml_type)`: weights quantized into Q4_0 / Q4_1 / Q5_0 /
  Q5_1 / Q8_0 exactly as llama.cpp does (`affineq.gguf.block_quant`), so they save as that type bit for bit.
- `save_model(model, path, tokenizer=None)` / `save_file(tensors, path, arch=...)`: write GGUF files llama.cpp
  loads, each quantized weight as the GGUF type that holds it exactly.

Needs ggml-org's `gguf` package (`pip install 'affineq[gguf]'`), imported on first use.
"""

from affineq.gguf.block_quant import BLOCK_QUANT_TYPES, GGUFBlockConfig, quantize_blocks
from affineq.gguf.files import load_file, save_file
from affineq.gguf.models import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer, save_model
from affineq.gguf.types import READ_TYPES, WRITE_TYPES

__all__ = ["BLOCK_QUANT_TYPES", "READ_TYPES", "SUPPORTED_ARCHITECTURES", "WRITE_TYPES", "GGUFBlockConfig",
           "load_file", "load_model", "load_tokenizer", "quantize_blocks", "save_file", "save_model"]
