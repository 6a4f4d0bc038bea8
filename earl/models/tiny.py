"""A tiny Qwen2 model with a byte/char-level ChatML tokenizer, built offline from a seed.

This module writes a normal Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) that both transformers and
vLLM load. It is the default model for tests and quick runs: random weights, so it learns
only what RL teaches it. It is not a pretrained model (see `earl.models.smollm2`).

Vocabulary: the special tokens below (ids 0-6), then the 256 bytes (so every ASCII character,
newline included, is one token and nothing is ever unknown), then reserved special tokens that
pad the vocabulary to `vocab_size`. The chat template is ChatML; `tools` are rendered
Qwen/Hermes-style and assistant tool calls as `<tool_call>{"name": .., "arguments": ..}</tool_call>`,
tool results as `<tool_response>..</tool_response>` inside a user turn.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import TokenizersBackend

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
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
# Same pre-tokenizer as transformers' Qwen2Tokenizer, which AutoTokenizer (and so vLLM) forces
# for model_type "qwen2" whatever tokenizer.json says: both loaders then agree on every id.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_BUILD_VERSION = 2  # bump when the folder layout or template changes: invalidates caches


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable unicode map, in byte order (space -> "Ġ", newline -> "Ċ")."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


BYTES = tuple(_byte_symbols())

# transformers renders with trim_blocks: a newline right after a `%}` is eaten, hence {{ NL }}.
CHAT_TEMPLATE = (
    "{% set NL = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ NL }}{{ NL }}{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures are within "
    "<tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ NL }}{{ tool | tojson }}{% endfor %}{{ NL }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}</tool_call><|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if (loop.first and message.content) or not loop.first %}{{ NL }}{% endif %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>{{ NL }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ message.content }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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
    vocab_size: int = 320
    max_positions: int = 4096
    init_std: float = 0.02
    tie_embeddings: bool = True

    def validate(self) -> None:
        n_min = len(SPECIAL_TOKENS) + len(BYTES)
        if self.vocab_size < n_min:
            raise ValueError(f"vocab_size={self.vocab_size} < {n_min}: raise vocab_size")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def vocabulary(vocab_size: int = 320) -> list[str]:
    """Token strings in id order: specials, the 256 byte symbols, reserved padding tokens."""
    base = list(SPECIAL_TOKENS) + list(BYTES)
    return base + [f"<|reserved_{i}|>" for i in range(vocab_size - len(base))]


def _added_tokens(vocab_size: int) -> list[tuple[int, str, bool]]:
    """(id, content, special) for every non-byte token."""
    return [(i, t, t not in _NOT_SPECIAL)
            for i, t in enumerate(vocabulary(vocab_size)) if i >= len(SPECIAL_TOKENS) + 256 or i < len(SPECIAL_TOKENS)]


def _raw_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    vocab = vocabulary(vocab_size)
    # BPE without merges over byte symbols = one token per byte (per ASCII character).
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[],
                               unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence([
        pre.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=sp, normalized=False)
                            for _, t, sp in _added_tokens(vocab_size)])
    return tok


def _tokenizer_config(vocab_size: int, model_max_length: int) -> dict[str, object]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": sp}
            for i, t, sp in _added_tokens(vocab_size)
        },
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(vocab_size: int = 320, model_max_length: int = 4096) -> TokenizersBackend:
    """Return the tokenizer in memory, as `AutoTokenizer.from_pretrained` would load it."""
    from transformers import TokenizersBackend

    cfg = _tokenizer_config(vocab_size, model_max_length)
    return TokenizersBackend(
        tokenizer_object=_raw_tokenizer(vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in cfg.items() if k == "add_prefix_space"},
    )


def _write_tokenizer(out: Path, cfg: TinyConfig) -> None:
    _raw_tokenizer(cfg.vocab_size).save(str(out / "tokenizer.json"))
    tcfg = _tokenizer_config(cfg.vocab_size, cfg.max_positions)
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
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    hf_cfg.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(hf_cfg)
    model.to(dtype=torch.float32)  # type: ignore[call-arg]  # transformers stub quirk
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
    vocab_size: int = 320,
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


def default_model_dir(**kwargs: float) -> Path:
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
