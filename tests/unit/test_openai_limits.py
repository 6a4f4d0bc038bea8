"""Bounds that keep one request from stalling the endpoint's process: a body of millions of tiny
JSON values is refused before `json.loads` (which holds the GIL), and long texts are tokenized
with the GIL released and not cached."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from earl.agents.openai_protocol import APIError, Limits, parse_request


def _tiny_values_body(n: int) -> bytes:
    head = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    return (head[:-1] + ', "metadata": [' + "[]," * n + "[]]}").encode()


def test_a_body_of_millions_of_tiny_values_is_refused_before_parsing() -> None:
    with pytest.raises(APIError) as info:
        parse_request(_tiny_values_body(3_000_000), model="m")
    assert info.value.status == 400 and info.value.code == "request_too_large"
    assert "JSON arrays/objects" in info.value.message and "max_messages" in info.value.message


def test_the_bound_scales_with_the_limits() -> None:
    body = _tiny_values_body(100_000)
    with pytest.raises(APIError, match="JSON arrays/objects"):
        parse_request(body, model="m", limits=Limits(max_messages=16, max_tools=16))
    try:  # within the default bound: parsed, then judged on its fields
        parse_request(body, model="m")
    except APIError as exc:
        assert "JSON arrays/objects" not in exc.message


_GIL_PROBE = textwrap.dedent("""
    import json, threading, time
    from earl.agents.chat import ChatCodec
    from earl.models.tiny import build_tokenizer
    codec = ChatCodec(build_tokenizer())
    text = "lorem ipsum dolor " * 60_000  # ~1M characters
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        ids = codec.encode_text(text)
    finally:
        stop.set()
        t.join()
    print(json.dumps({"ticks": len(ticks), "cached": text in codec._memo,
                      "same": ids == list(codec.tokenizer.encode(text, add_special_tokens=False))}))
""")


def test_a_long_text_is_tokenized_without_holding_the_gil() -> None:
    # in a process of its own: tokenizing 1M characters leaves allocator state behind that
    # other tests measuring this process's memory would see
    out = subprocess.run([sys.executable, "-c", _GIL_PROBE], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["same"]
    # the ticker kept running while the text was encoded: it got the GIL back many times
    assert got["ticks"] > 20
    assert not got["cached"]  # not cached: it would pin ~1M characters
