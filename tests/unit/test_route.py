"""The data plane's per-pair choice: shm on one host, the network across hosts, overrides."""

from __future__ import annotations

import pytest

from earl.runtime import locality
from earl.runtime.transport import available
from earl.runtime.transport.route import ENV_PREFER, Inbox, pick, preferred

NET = "ucx" if available("ucx") else "zmq"


@pytest.fixture
def on_host_a(monkeypatch: pytest.MonkeyPatch):
    """This process declares host "host-a" (the override tests and namespace-less setups use)."""
    monkeypatch.setenv(locality.ENV_HOST_ID, "host-a")
    monkeypatch.delenv(ENV_PREFER, raising=False)
    locality.host_id.cache_clear()
    yield
    locality.host_id.cache_clear()


def test_host_id_override_and_same_host(on_host_a) -> None:
    assert locality.host_id() == "host-a"
    assert locality.same_host("host-a", "host-a")
    assert not locality.same_host("host-a", "host-b")
    assert not locality.same_host("", "")  # an unknown host is never this one


def test_same_host_is_shm_and_another_host_the_network(on_host_a) -> None:
    assert pick("host-a") == "shm"
    assert pick("host-b") == NET
    assert pick("") == NET  # unknown: never shared memory
    inbox = Inbox()
    assert inbox.kind_for("host-a") == "shm" and inbox.kind_for("host-b") == NET


def test_overrides_force_one_kind(on_host_a, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pick("host-a", "zmq") == "zmq"
    assert Inbox("zmq").kind_for("host-a") == "zmq"
    monkeypatch.setenv(ENV_PREFER, "zmq")
    assert preferred() == "zmq" and pick("host-a") == "zmq" and pick("host-b") == "zmq"
    assert pick("host-b", "shm") == "shm"  # the caller's choice beats the environment's


def test_bad_overrides_name_the_setting(on_host_a, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="transport 'gloo' cannot carry a data-plane pair"):
        pick("host-b", "gloo")
    with pytest.raises(ValueError, match="Inbox prefer='tcp'"):
        Inbox("tcp")
    monkeypatch.setenv(ENV_PREFER, "nccl")
    with pytest.raises(ValueError, match=r"EARL_TRANSPORT='nccl' \(placement.transport\)"):
        pick("host-a")
