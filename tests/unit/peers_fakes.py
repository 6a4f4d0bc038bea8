"""Fakes shared by the unit tests of bench/'s TRL multi-turn loops."""

from __future__ import annotations


class Tok:
    """A chat template that is a concatenation of per-message tokens (prefix-consistent)."""

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool,
                            tokenize: bool, return_dict: bool) -> list[int]:
        out = [t for m in messages for t in (1, len(m["content"]) % 50 + 2, 3)]
        return out + [4] if add_generation_prompt else out

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "7"
