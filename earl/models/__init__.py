"""Models EARL can build or load offline: the tiny seeded Qwen2 (`tiny`) and SmolLM2-135M.

`resolve_model("tiny" | "smollm2-135m" | path)` turns a `--model` value into an HF folder.
"""

from earl.models.smollm2 import resolve_model as resolve_model
from earl.models.smollm2 import smollm2_dir as smollm2_dir
from earl.models.tiny import build_tiny_model as build_tiny_model
from earl.models.tiny import build_tokenizer as build_tokenizer
from earl.models.tiny import default_model_dir as default_model_dir

__all__ = ["build_tiny_model", "build_tokenizer", "default_model_dir", "resolve_model",
           "smollm2_dir"]
