"""GGUF in and out: llama.cpp's files as affineq tensors and models, and affineq models as GGUF files.

- `load_file(path)`: every tensor of a GGUF file; quantized ones as `AffineQuantizedTensor`s holding the file's
  codes and scales (`affineq.gguf.types` lists the types and how each is held exactly).
- `load_model(path)` / `load_tokenizer(path)`: a transformers model (Llama family, Qwen2, Mistral, Gemma 3)
  and its tokenizer from a GGUF file (`affineq.gguf.models`).
- `save_model(model, path, tokenizer=None)` / `save_file(tensors, path, arch=...)`: write GGUF files llama.cpp
  loads, each quantized weight as the GGUF type that holds it exactly.

Needs ggml-org's `gguf` package (`pip install 'affineq[gguf]'`), imported on first use.
"""

from affineq.gguf.files import load_file, save_file
from affineq.gguf.models import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer, save_model
from affineq.gguf.types import READ_TYPES, WRITE_TYPES

__all__ = ["READ_TYPES", "SUPPORTED_ARCHITECTURES", "WRITE_TYPES", "load_file", "load_model", "load_tokenizer",
           "save_file", "save_model"]
