"""@endpoint argument checking, endpoint discovery, handles and config validation (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from earl.runtime import Actor, ActorGroup, RestartPolicy, RuntimeConfig, endpoint, wire
from earl.runtime.endpoint import endpoints_of


class Base(Actor):
    @endpoint
    async def a(self, x: int, y: float = 1.0, *, tag: str | None = None) -> float:
        return x * y

    @endpoint
    async def gen(self, n: int):
        yield n

    @endpoint
    def sync(self, arr: np.ndarray, items: list[int], opts: dict[str, int]) -> int:
        return len(items)

    @endpoint
    async def anything(self, v, w: object, z: list | tuple) -> None:
        return None

    async def not_an_endpoint(self) -> None:
        return None


class Child(Base):
    @endpoint
    async def a(self, x: int, y: float = 1.0, *, tag: str | None = None) -> float:
        return 0.0

    gen = None  # type: ignore[assignment]  # hides the inherited endpoint


def test_endpoints_are_discovered_through_inheritance():
    eps = endpoints_of(Child)
    assert sorted(eps) == ["a", "anything", "sync"]
    assert eps["a"] is Child.__dict__["a"]
    assert endpoints_of(Base)["gen"].is_stream and not endpoints_of(Base)["a"].is_stream
    assert not endpoints_of(Base)["sync"].is_async


def test_endpoint_stays_a_method_inside_the_actor():
    obj = Base.__new__(Base)
    assert obj.sync(np.zeros(1), [1, 2], {}) == 2


@pytest.mark.parametrize(("args", "kwargs"), [
    ([1], {}), ([1, 2], {}), ([True, 2.5], {"tag": None}), ([1], {"tag": "x"}),
])
def test_check_accepts_matching_arguments(args, kwargs):
    endpoints_of(Base)["a"].check("Base", args, kwargs)


@pytest.mark.parametrize(("name", "args", "kwargs", "msg"), [
    ("a", ["1"], {}, "argument 'x' must be int, got str"),
    ("a", [1, "2"], {}, "argument 'y' must be float | int, got str"),
    ("a", [1], {"tag": 3}, "argument 'tag' must be NoneType | str, got int"),
    ("sync", [[1, 2], [], {}], {}, "argument 'arr' must be ndarray, got list"),
    ("sync", [np.zeros(1), {}, {}], {}, "argument 'items' must be list | tuple, got dict"),
])
def test_check_names_the_bad_argument(name, args, kwargs, msg):
    with pytest.raises(TypeError, match=msg.replace("|", r"\|")):
        endpoints_of(Base)[name].check("Base", args, kwargs)


def test_unannotated_and_object_arguments_are_not_checked():
    endpoints_of(Base)["anything"].check("Base", [object(), 3, (1,)], {})


def test_group_handles_check_endpoint_names_and_travel_on_the_wire():
    g = ActorGroup("grp", "Base", {"a": False, "gen": True}, ["unix:/a", "unix:/b"], [0, 1], 2)
    with pytest.raises(AttributeError, match="no endpoint 'nope'; endpoints: a, gen"):
        g.nope  # noqa: B018
    with pytest.raises(TypeError, match=r"called with \.stream\(\)"):
        g.gen.call_one(1)
    with pytest.raises(ValueError, match="call_one needs a group of one actor"):
        g.a.call_one(1)
    assert g[1].addresses == ["unix:/b"] and g[-1] is g[1] and len(list(g)) == 2
    with pytest.raises(IndexError):
        g[2]
    body, bufs = wire.encode({"handle": g})
    back = wire.decode(body, bufs)["handle"]
    assert isinstance(back, ActorGroup)
    assert (back.name, back.addresses, back.ranks, back.endpoints) == (
        "grp", ["unix:/a", "unix:/b"], [0, 1], {"a": False, "gen": True})


def test_endpoint_rejects_non_callables():
    with pytest.raises(TypeError, match="decorates a method"):
        endpoint(3)  # type: ignore[call-overload]


def test_config_and_policy_validation(monkeypatch):
    monkeypatch.delenv("EARL_RPC_SECRET", raising=False)
    with pytest.raises(ValueError, match="max_message_bytes"):
        RuntimeConfig(max_message_bytes=10)
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    monkeypatch.setenv("EARL_RPC_SECRET", "s" * 20)
    cfg = RuntimeConfig(host="10.0.0.5", launcher="ray")
    assert cfg.secret_bytes == b"s" * 20 and cfg.use_tcp
    p = RestartPolicy(max_restarts=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [p.delay(k) for k in range(4)] == [0.5, 1.0, 2.0, 3.0]


async def _no_await(x: int) -> int:
    return x + 1


async def _awaits(x: int) -> int:
    import asyncio

    await asyncio.sleep(0)
    return x


async def _async_with(lock) -> None:
    async with lock:
        pass


async def _async_comprehension(it) -> list:
    return [x async for x in it]


def test_endpoints_without_await_points_are_run_inline():
    from earl.runtime.endpoint import _can_suspend

    assert not _can_suspend(_no_await)
    assert _can_suspend(_awaits) and _can_suspend(_async_with)
    assert _can_suspend(_async_comprehension)
    assert endpoint(_no_await).never_suspends  # type: ignore[arg-type]
    assert not endpoint(_awaits).never_suspends  # type: ignore[arg-type]


async def test_a_coroutine_stepped_once_can_be_resumed_in_a_task():
    import asyncio

    from earl.runtime.server import _Resume

    coro = _awaits(7)
    yielded = coro.send(None)  # suspends at sleep(0)

    async def finish():
        return await _Resume(coro, yielded)

    assert await asyncio.wait_for(asyncio.create_task(finish()), 5) == 7


def test_group_handles_pickle_as_plain_data():
    import pickle

    g = ActorGroup("grp", "Base", {"a": False}, ["tcp:10.0.0.1:5"], [3], 8)
    back = pickle.loads(pickle.dumps(g))
    assert (back.name, back.addresses, back.ranks, back.world_size) == (
        "grp", ["tcp:10.0.0.1:5"], [3], 8)


def test_encode_from_another_thread_uses_its_own_packer():
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.update(r=wire.encode({"x": (1, np.arange(3))})))
    t.start()
    t.join()
    body, bufs = out["r"]
    back = wire.decode(body, [bytearray(memoryview(b).cast("B")) for b in bufs])
    assert back["x"][0] == 1 and back["x"][1].tolist() == [0, 1, 2]
