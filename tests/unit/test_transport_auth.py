"""The data plane's MACs (earl.runtime.transport.auth): a sealed payload opens only with the same
channel key, sender nonce, sequence number and bytes; HMAC digests bind the sequence number."""

from __future__ import annotations

import os

import numpy as np
import pytest

from earl.runtime.transport.auth import MAC_LEN, NONCE_LEN, TAG_LEN, Mac
from earl.runtime.transport.base import TransportError

SECRET = b"s" * 32


def test_a_sealed_payload_opens_only_as_sent() -> None:
    mac = Mac(SECRET, b"chan")
    nonce = os.urandom(NONCE_LEN)
    payload = np.arange(1 << 16, dtype=np.uint8)
    tag = mac.seal(nonce, 7, [b"header", payload])
    assert len(tag) == TAG_LEN
    mac.open(nonce, 7, [b"header", memoryview(payload.tobytes())], tag)  # views of the same bytes
    tampered = payload.copy()
    tampered[12345] ^= 1
    for args in ((nonce, 8, [b"header", payload]),              # another sequence number
                 (os.urandom(NONCE_LEN), 7, [b"header", payload]),  # another sender
                 (nonce, 7, [b"header", tampered]),              # one bit flipped
                 (nonce, 7, [b"headeR", payload])):
        with pytest.raises(TransportError, match="failed authentication"):
            mac.open(*args, tag)  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="failed authentication"):
        Mac(b"w" * 32, b"chan").open(nonce, 7, [b"header", payload], tag)  # another secret
    with pytest.raises(TransportError, match="failed authentication"):
        Mac(SECRET, b"other").open(nonce, 7, [b"header", payload], tag)  # another channel


def test_one_time_keys_differ_per_sender_and_sequence() -> None:
    mac = Mac(SECRET, b"chan")
    a, b = os.urandom(NONCE_LEN), os.urandom(NONCE_LEN)
    tags = {mac.seal(n, s, [b"same bytes"]) for n in (a, b) for s in (0, 1)}
    assert len(tags) == 4  # never one key for two messages
    with pytest.raises(TransportError, match="nonce"):
        mac.seal(b"short", 0, [b"x"])


def test_hmac_digest_binds_the_sequence_number() -> None:
    mac = Mac(SECRET, b"chan")
    d = mac.digest(3, [b"ctrl"])
    assert len(d) == MAC_LEN
    mac.check(3, [b"ctrl"], d)
    with pytest.raises(TransportError):
        mac.check(4, [b"ctrl"], d)
