"""A tiny Qwen2 model with a char-level ChatML tokenizer, built offline from a seed.

This module writes a normal Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) that both transformers and
vLLM load. It is the default model for tests and quick runs: random weights, so it learns
only what RL teaches it. It is not a pretrained model (see `earl.models.smollm2`).

Vocabulary: the special tokens below (ids 0-6), then printable ASCII and newline (one token
per character), then reserved special tokens that pad the vocabulary to `vocab_size`. Any
other character is normalized to "?" (tab to a space).

Example:
    >>> from earl.models.tiny import default_model_dir
    >>> path = default_model_dir()          # built once per config, then cached
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# Tool-call markers must survive `decode(skip_special_tokens=True)` so parsers can see them.
_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n",)
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
_BUILD_VERSION = 1  # bump when the folder layout or template changes: invalidates caches

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures are within "
    "<tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}</tool_call><|im_end|>\n"
    "{%- elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and message.content) or not loop.first %}\n{% endif %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{%- if tool_call.arguments is string %} {{ tool_call.arguments }}"
    "{%- else %} {{ tool_call.arguments | tojson }}{%- endif %}}</tool_call>"
    "{%- endfor %}"
    "{%- endif %}"
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{%- endif %}"
    "\n<tool_response>{{ message.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{%- endif %}"
    "{%- else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@dataclass(kw_only=True, frozen=True)
class TinyConfig:
    """Shape of the tiny model. The defaults give ~0.8M parameters."""

    seed: int = 0
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    vocab_size: int = 128
    max_positions: int = 4096
    init_std: float = 0.02
    tie_embeddings: bool = True

    def validate(self) -> None:
        n_min = len(SPECIAL_TOKENS) + len(CHARS)
        if self.vocab_size < n_min:
            raise ValueError(f"vocab_size={self.vocab_size} < {n_min}: raise vocab_size")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def vocabulary(vocab_size: int = 128) -> list[str]:
    """Token strings in id order: specials, characters, then reserved padding tokens."""
    base = list(SPECIAL_TOKENS) + list(CHARS)
    return base + [f"<|reserved_{i}|>" for i in range(vocab_size - len(base))]


def build_tokenizer(vocab_size: int = 128, model_max_length: int = 4096):  # noqa: ANN201
    """Return the char-level `PreTrainedTokenizerFast` (built in memory, no files read)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(vocab_size)
    # BPE without merges = one token per character; specials are matched before the model.
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Replace("\t", " "), normalizers.Replace(Regex("[^\\x20-\\x7e\\n]"), "?")]
    )
    tok.decoder = decoders.Fuse()
    specials = [t for t in vocab if t not in CHARS]
    tok.add_special_tokens(
        [AddedToken(t, special=t not in _NOT_SPECIAL, normalized=False) for t in specials]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _write_tokenizer(out: Path, cfg: TinyConfig) -> None:
    tok = build_tokenizer(cfg.vocab_size, cfg.max_positions)
    tok._tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": t not in _NOT_SPECIAL}
        for i, t in enumerate(vocabulary(cfg.vocab_size)) if t not in CHARS
    }
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": cfg.max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))


def _write_model(out: Path, cfg: TinyConfig) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = vocabulary(cfg.vocab_size)
    eos, pad = vocab.index(EOS_TOKEN), vocab.index(PAD_TOKEN)
    hf_cfg = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(hf_cfg).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 384,
    vocab_size: int = 128,
    max_positions: int = 4096,
    init_std: float = 0.02,
    tie_embeddings: bool = True,
) -> Path:
    """Write the tiny model + tokenizer to `out_dir` (created; existing files overwritten).

    Same arguments -> bit-identical weights. Returns the folder path.
    """
    cfg = TinyConfig(seed=seed, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, vocab_size=vocab_size,
                     max_positions=max_positions, init_std=init_std,
                     tie_embeddings=tie_embeddings)
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_model(out, cfg)
    _write_tokenizer(out, cfg)
    (out / "earl_tiny.json").write_text(json.dumps(asdict(cfg) | {"build": _BUILD_VERSION}))
    return out


def cache_root() -> Path:
    """`$EARL_CACHE_DIR` or ~/.cache/earl."""
    return Path(os.environ.get("EARL_CACHE_DIR", Path.home() / ".cache" / "earl"))


def default_model_dir(**kwargs: int | float | bool) -> Path:
    """A cached build of `build_tiny_model(**kwargs)` under `cache_root()/models/<hash>`.

    Safe to call from concurrent processes: each builds into a temp dir and renames it.
    """
    cfg = TinyConfig(**kwargs)  # type: ignore[arg-type]
    cfg.validate()
    key = json.dumps(asdict(cfg) | {"build": _BUILD_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    final = cache_root() / "models" / f"tiny-{digest}"
    if (final / "earl_tiny.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build_tiny_model(tmp, **asdict(cfg))
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            if not (final / "earl_tiny.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
