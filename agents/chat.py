"""Token-exact multi-turn encoding with a Hugging Face tokenizer's chat template.

The first prompt is rendered by `apply_chat_template`. After that, earlier tokens are never
re-tokenized: each new batch of messages (tool results, observations) is encoded as the *delta*
the template adds after an assistant turn, so the prompt of turn k+1 is exactly the tokens of
turn k (sampled tokens included) plus the new tokens. The delta is found by rendering a dummy
conversation with and without the new messages; its frame (the text around each message's
content) is cached per message-role pattern after checking it against a real render, so the
template runs only on the first turns. This module does not talk to engines or tools.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Sequence
from typing import Protocol

__all__ = ["ChatCodec", "Message"]

Message = dict[str, object]
_BASE: list[Message] = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
_CHECKS = 2
_MEMO_MAX_CHARS = 1 << 14  # longer texts are not cached
_GIL_FREE_CHARS = 1 << 12  # longer texts are encoded with the GIL released (a thread may wait)
_MEMO_SIZE = 1 << 16  # cached encodings (FIFO eviction)


class _Tokenizer(Protocol):  # the part of PreTrainedTokenizerFast we use
    eos_token: str
    eos_token_id: int

    def apply_chat_template(self, conversation: list[Message], **kw: object) -> object: ...
    def convert_tokens_to_ids(self, token: str) -> int: ...


class ChatCodec:
    """Encodes chat messages to token ids incrementally and decodes generations.

    Args:
        tokenizer: a `PreTrainedTokenizerFast` with a chat template.
        end_token: the token that closes an assistant turn (default: the tokenizer's eos).

    Example:
        >>> codec = ChatCodec(tokenizer)
        >>> ids = codec.encode_prompt([{"role": "user", "content": "hi"}])
        >>> ids += generated + codec.encode_continuation([{"role": "user", "content": "more"}])
    """

    def __init__(self, tokenizer: _Tokenizer, end_token: str | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template; load one with a ChatML template "
                             "(e.g. earl.models.tiny.default_model_dir())")
        self.tokenizer = tokenizer
        self.end_token = end_token or tokenizer.eos_token
        self.end_id = int(tokenizer.convert_tokens_to_ids(self.end_token))
        self._fast = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer, skips wrappers
        stops = {self.end_id}
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids = sorted(stops)
        self._memo: dict[str, tuple[int, ...]] = {}
        self._pframes: dict[object, tuple[tuple[object, ...], list[str] | None, int]] = {}
        self._unmemo: dict[tuple[int, ...], str] = {}
        self._frames: dict[tuple[object, ...], list[str] | None] = {}
        self._checked: dict[tuple[object, ...], int] = {}
        self._added: dict[str, int] = {}
        self._split = self._added_token_splitter()
        self._split_checks = 0

    # -- text <-> ids -------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added).

        Memoized, and split at added tokens (<|im_start|>, <tool_call>, ...) which tokenizers
        never merge across, so a shared system prompt or a repeated board is encoded once
        however many sessions use it. The split is checked against whole-text encoding on the
        first calls and dropped if a tokenizer disagrees.
        """
        ids = self._memo.get(text)
        if ids is None:
            if self._split is None:
                ids = self._encode_raw(text)
            else:
                parts: list[int] = []
                for piece in self._split.split(text):
                    if not piece:
                        continue
                    tid = self._added.get(piece)
                    if tid is not None:
                        parts.append(tid)
                    else:
                        parts += self._encode_piece(piece)
                ids = tuple(parts)
                if self._split_checks < _CHECKS * 4:
                    self._split_checks += 1
                    if ids != self._encode_raw(text):
                        self._split = None  # this tokenizer merges across added tokens
                        self._memo.clear()
                        ids = self._encode_raw(text)
            self._remember(text, ids)
        return list(ids)

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        ids = self._memo.get(piece)
        if ids is None:
            ids = self._encode_raw(piece)
            self._remember(piece, ids)
        return ids

    def _remember(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > _MEMO_MAX_CHARS:
            return  # one huge prompt would pin its text and ids for 65k more encodings
        if len(self._memo) >= _MEMO_SIZE:
            # drop the oldest entry; another thread (the endpoint's parser) may evict too
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                self._memo.pop(next(iter(self._memo)))
        self._memo[text] = ids

    def _encode_raw(self, text: str) -> tuple[int, ...]:
        if self._fast is not None:
            if len(text) > _GIL_FREE_CHARS:  # encode_batch releases the GIL, encode does not
                return tuple(self._fast.encode_batch([text], add_special_tokens=False)[0].ids)
            return tuple(self._fast.encode(text, add_special_tokens=False).ids)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    def _added_token_splitter(self) -> re.Pattern[str] | None:
        """A regex splitting text at added tokens, or None when their options make it unsafe."""
        getter = getattr(self._fast, "get_added_tokens_decoder", None)
        if getter is None:
            return None
        tokens = getter()
        for tid, tok in tokens.items():
            if tok.lstrip or tok.rstrip or tok.single_word or tok.normalized:
                return None
            self._added[tok.content] = int(tid)
        if not self._added:
            return None
        alts = sorted(self._added, key=len, reverse=True)
        return re.compile("(" + "|".join(re.escape(a) for a in alts) + ")")

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included. Short sequences (moves, answers) are memoized."""
        key = tuple(ids) if len(ids) <= 16 else None
        if key is not None and (text := self._unmemo.get(key)) is not None:
            return text
        if self._fast is not None:
            text = self._fast.decode(list(ids), skip_special_tokens=False)
        else:
            text = str(self.tokenizer.decode(list(ids), skip_special_tokens=False))  # type: ignore[attr-defined]
        if key is not None:
            if len(self._unmemo) >= _MEMO_SIZE:
                with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                    self._unmemo.pop(next(iter(self._unmemo)))
            self._unmemo[key] = text
        return text

    def render(self, messages: list[Message], tools: list[dict[str, object]] | None = None,
               add_generation_prompt: bool = True) -> str:
        return str(self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            tokenize=False))

    # -- prompts ------------------------------------------------------------------------------
    def encode_prompt(self, messages: list[Message],
                      tools: list[dict[str, object]] | None = None) -> list[int]:
        """Token ids of the first prompt, ending with the assistant generation header."""
        if not messages:
            raise ValueError("messages is empty; give at least one user message")
        return self.encode_text(self.prompt_text(messages, tools))

    def prompt_text(self, messages: list[Message],
                    tools: list[dict[str, object]] | None = None) -> str:
        """The rendered first prompt. Like continuations, it is filled into a cached frame per
        (tools, role pattern) once the frame has matched real renders."""
        tools_t = tuple(tools or ())
        roles = _frame_key(messages)
        key = None if roles is None else (tuple(map(id, tools_t)), roles)
        entry = self._pframes.get(key) if key is not None else None
        if entry is not None and all(map(operator.is_, entry[0], tools_t)) \
                and entry[1] is not None and not any(_unusual(m) for m in messages):
            frame = entry[1]
            parts = [frame[0]]
            for m, tail in zip(messages, frame[1:], strict=True):
                parts.append(str(m.get("content") or ""))
                parts.append(tail)
            text = "".join(parts)
            if entry[2] >= _CHECKS:
                return text
            exact = self.render(messages, tools)
            self._pframes[key] = (entry[0], frame if exact == text else None, entry[2] + 1)
            return exact
        exact = self.render(messages, tools)
        if key is not None and (entry is None or not all(map(operator.is_, entry[0], tools_t))):
            marks = [f"\x1eEARL{i}\x1e" for i in range(len(messages))]
            dummy = [dict(m, content=mark) for m, mark in zip(messages, marks, strict=True)]
            frame = _split_marks(self.render(dummy, tools), marks)
            if len(self._pframes) >= 1024:
                self._pframes.pop(next(iter(self._pframes)))
            self._pframes[key] = (tools_t, frame, 0)
        return exact

    def continuation_text(self, new_messages: list[Message]) -> str:
        """Text the template puts after an assistant turn's end token, for `new_messages`."""
        key = _frame_key(new_messages)
        frame = self._frames.get(key) if key is not None else None
        if frame is not None and any(_unusual(m) for m in new_messages):
            frame = None  # templates often trim content: render edge cases exactly
        if frame is not None:
            parts = [frame[0]]
            for m, tail in zip(new_messages, frame[1:], strict=True):
                parts.append(str(m.get("content") or ""))
                parts.append(tail)
            text = "".join(parts)
            n = self._checked.get(key, 0)  # type: ignore[arg-type]
            if n >= _CHECKS:
                return text
            exact = self._delta(new_messages)
            if exact == text:
                self._checked[key] = n + 1  # type: ignore[index]
            else:
                self._frames[key] = None  # type: ignore[index]  # template transforms content
            return exact
        exact = self._delta(new_messages)
        if key is not None and key not in self._frames:
            self._frames[key] = self._make_frame(new_messages)
        return exact

    def encode_continuation(self, new_messages: list[Message]) -> list[int]:
        """Token ids to append after a closed assistant turn: the messages + generation header."""
        return self.encode_text(self.continuation_text(new_messages))

    def _delta(self, new_messages: list[Message]) -> str:
        before = self.render(_BASE, add_generation_prompt=False)
        cut = before.rfind(self.end_token)
        if cut < 0:
            raise ValueError(f"the chat template does not close assistant turns with "
                             f"{self.end_token!r}; pass ChatCodec(end_token=...)")
        prefix = before[: cut + len(self.end_token)]
        full = self.render(_BASE + list(new_messages))
        if not full.startswith(prefix):
            raise ValueError("the chat template renders earlier turns differently once new "
                             "messages follow; token-exact multi-turn needs an append-only template")
        return full[len(prefix):]

    def _make_frame(self, new_messages: list[Message]) -> list[str] | None:
        marks = [f"\x1eEARL{i}\x1e" for i in range(len(new_messages))]
        dummy = [dict(m, content=mark) for m, mark in zip(new_messages, marks, strict=True)]
        return _split_marks(self._delta(dummy), marks)


def _split_marks(text: str, marks: list[str]) -> list[str] | None:
    """Cut `text` at each mark in order: the frame around the contents, or None."""
    frame: list[str] = []
    for mark in marks:
        head, sep, text = text.partition(mark)
        if not sep:
            return None
        frame.append(head)
    frame.append(text)
    return frame


def _unusual(message: Message) -> bool:
    content = str(message.get("content") or "")
    return content != content.strip() or "\x1e" in content


def _frame_key(messages: list[Message]) -> tuple[object, ...] | None:
    key: list[object] = []
    for m in messages:
        if not isinstance(m.get("content", ""), str):
            return None
        extra = tuple(sorted((k, v) for k, v in m.items() if k != "content"))
        try:
            hash(extra)
        except TypeError:
            return None
        key.append(extra)
    return tuple(key)
