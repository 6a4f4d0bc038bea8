"""The tiny model builder: deterministic weights, a tokenizer both loaders agree on, tools template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from earl.models import tiny


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_weights_depend_only_on_seed(built: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    again = tiny.build_tiny_model(tmp_path / "a", seed=0)
    other = tiny.build_tiny_model(tmp_path / "b", seed=1)
    w0, w1, w2 = (load_file(p / "model.safetensors") for p in (built, again, other))
    assert w0.keys() == w1.keys() == w2.keys()
    assert all(w0[k].equal(w1[k]) for k in w0)
    assert not w0["model.embed_tokens.weight"].equal(w2["model.embed_tokens.weight"])


def test_hf_folder_is_a_small_qwen2(built: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = json.loads((built / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["max_position_embeddings"] >= 2048
    model = AutoModelForCausalLM.from_pretrained(built)
    n = sum(p.numel() for p in model.parameters())
    assert 300_000 < n < 2_000_000
    assert model.lm_head.weight is model.model.embed_tokens.weight
    out = model(torch.tensor([[1, 50, 51]])).logits
    assert out.shape == (1, 3, cfg["vocab_size"])
    assert cfg["eos_token_id"] == tiny.vocabulary().index("<|im_end|>")


def test_tokenizer_roundtrip_and_loaders_agree(built: Path) -> None:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(built)
    inmem = tiny.build_tokenizer()
    text = 'hi there\n\tok é <tool_call>{"a": 1}</tool_call><|im_end|>  x\n'
    ids = loaded.encode(text)
    assert ids == inmem.encode(text)
    assert loaded.decode(ids) == text
    assert loaded.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")
    ascii_text = "".join(chr(c) for c in range(32, 127)) + "\n"
    assert len(loaded.encode(ascii_text)) == len(ascii_text)  # one token per character
    for t in tiny.SPECIAL_TOKENS:
        assert loaded.convert_tokens_to_ids(t) == tiny.vocabulary().index(t)
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    assert len(loaded) == 320


def test_chat_template_renders_tools_and_tool_calls(built: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert (
        '<|im_start|>user\nadd 1 2<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
        '</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>3</tool_response><|im_end|>\n'
        '<|im_start|>assistant\n'
    ) in text
    plain = tok.apply_chat_template([{"role": "system", "content": "s"},
                                     {"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_default_model_dir_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EARL_CACHE_DIR", str(tmp_path))
    first = tiny.default_model_dir(layers=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny.default_model_dir(layers=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "models"
    assert tiny.default_model_dir(layers=2) != first


@pytest.mark.parametrize(("kw", "field"), [
    ({"hidden": 130}, "hidden"), ({"kv_heads": 3}, "heads"), ({"vocab_size": 100}, "vocab_size"),
    ({"layers": 0}, "layers"),
])
def test_bad_shapes_name_the_field(tmp_path: Path, kw: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny.build_tiny_model(tmp_path, **kw)  # type: ignore[arg-type]
