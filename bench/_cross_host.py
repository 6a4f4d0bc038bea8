"""The cross-host case of bench/dispatch.py: experience on host B, a DP=2 x TP=2 trainer on host A.

The two hosts are Linux namespaces on this machine, made by tests/hosts.py (each its own veth
address, `/dev/shm` and `/tmp`); bench/dispatch.py puts the repository root on `sys.path` to
import it as `tests.hosts`. Both modes move the same bytes: 2 producers on B hold `n` samples
(bench/_dispatch_layout.py's six columns, constant per sample so every consumer can verify every byte it
reads), and each of the 4 trainer ranks on A checksums every byte of its DP half.

- decentralized: 2 warehouse processes on B (`Warehouse` over a `ShmArena`, as `WarehouseHost`
  keeps them) serve fetch requests on an authenticated zmq TCP control receiver. On A a driver
  plans the step (`plan_step`) and tells each DP leader its `ReplicaPlan`; the leader fetches its
  half straight from the warehouses (`gather_replica`) into the receiver its `Inbox` picks for a
  peer on another host (`transport.choose(same_host=False)`: ucx, over TCP, on A's address,
  every frame authenticated under the run's secret), and `forward`s it to its TP peer over shm.
- single controller, the way verl's DataProto moves through a Ray driver: a Ray cluster over
  the two hosts (head on A, worker node on B); 2 producer actors on B (`Host.resource`) hold
  the same bytes as numpy arrays already in B's object store (put before the timed span, one
  object per repetition, so each repetition pulls fresh bytes across); the driver on A
  `ray.get`s them (zero-copy), concatenates them into warm buffers of its own, splits per DP
  rank, `ray.put`s each DP half once (verl puts once per rank) and 4 consumer actors on A
  `ray.get` their half (zero-copy) and checksum it.
- the same single controller with its driver on a host of its own (C, the Ray head): the
  driver node of a cluster whose trainer ranks are elsewhere, where a single controller's bytes
  cross the network twice (B -> C, C -> A). The decentralized path does not depend on where
  its driver is (it sees metadata only), so its figure stands for both layouts.
- the caps (bench/_cross_host_caps.py): a raw TCP stream from B to A (after an HMAC
  challenge), and the data-plane MAC (Poly1305, `auth.Mac.seal`) on one core.

Keys of ``cross_host``: ``bytes`` (the experience; ``bytes_checked``: what the consumers
checksummed, each DP half by both TP ranks), ``transport`` / ``tp_transport`` (what carried
B -> leader and leader -> TP peer), ``decentralized_s`` / ``single_controller_s`` (medians;
``decentralized`` / ``single_controller``: median, min, max, every repetition after one
warm-up), ``speedup`` (their ratio), ``single_controller_own_host_s`` / ``speedup_own_host`` (the driver
on host C; ``single_controller_own_host``: its repetitions), ``decentralized_fetch_s`` (of it, the slower leader's
fetch from B), ``driver_peak_rss_MB`` (each driver's VmHWM after start-up and during its runs;
the Ray driver's counts the object-store pages it maps), ``tcp_GBps`` (``tcp``: its
repetitions) and ``mac_GBps``.

Each role runs as ``python bench/_cross_host.py ROLE`` on its host, reads its config as one
JSON line on stdin and answers JSON lines on stdout. `cross_host_bench` (in the bench's own
process) makes the hosts, runs the roles and returns the ``cross_host`` figures.

Not here: the one-host cases (dispatch.py), the hosts themselves (tests/hosts.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _cross_host_caps import (
    TIMEOUT_S,
    emit,
    mac_gbps,
    role_config,
    role_tcp_recv,
    role_tcp_send,
)
from _dispatch_layout import (
    _FILL,
    _WORDS,
    BYTES_PER_TOKEN,
    COLUMNS,
    _check,
    _fill,
    _peak_rss_mb,
    _reset_peak_rss,
    plan_all,
)

from earl.runtime.dispatch import FetchOp, forward, gather_replica, receive_replica
from earl.runtime.dock_index import SampleInfo
from earl.runtime.dock_warehouse import Warehouse
from earl.runtime.layout import Layout
from earl.runtime.locality import ENV_ADDRESS, host_id
from earl.runtime.transport import Sender
from earl.runtime.transport.auth import set_run_secret
from earl.runtime.transport.route import Inbox, open_sender
from earl.runtime.transport.shm_arena import ShmArena

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 32768
CTX = mp.get_context("spawn")


def samples_for(total_bytes: int) -> int:
    """How many samples (a multiple of 8, at least 8) make about `total_bytes`."""
    return max(8, total_bytes // (SEQ_LEN * BYTES_PER_TOKEN) // 8 * 8)


def _on_eof(stop: threading.Event) -> None:
    """Set `stop` when stdin closes (the bench's way of ending a role)."""
    def watch() -> None:
        sys.stdin.read()
        stop.set()
    threading.Thread(target=watch, daemon=True).start()


# -- decentralized: warehouses on B, the dispatcher's leaders and peers on A ------------------


def role_producer() -> None:
    """A warehouse shard on host B, serving fetch requests until stdin closes."""
    cfg = role_config()
    wh = Warehouse(cfg["name"], arena=ShmArena())
    infos = []
    for i in range(cfg["first"], cfg["first"] + cfg["n"]):
        sid = f"s{i}"
        infos.append(wh.put(sid, {c: np.full(SEQ_LEN, x) for c, x in _fill(sid).items()},
                            group_id=f"g{i}"))
    ctl = Inbox(prefer="zmq").receiver("zmq")  # TCP on this host's address, authenticated
    emit({"ctl": ctl.address, "host": host_id(),
           "infos": [dataclasses.asdict(i) for i in infos]})
    stop = threading.Event()
    _on_eof(stop)
    senders: dict[str, Sender] = {}
    while not stop.is_set():
        try:
            frame = ctl.recv(0.2)
        except TimeoutError:
            continue
        msg = json.loads(frame.header)
        frame.release()
        reply = msg["reply"]
        if reply not in senders:
            senders[reply] = open_sender(reply)  # ucx to a receiver on another host
        senders[reply].send(*wh.pack(msg["ids"], msg["columns"]))
    for s in senders.values():
        s.close()


def _consumer(secret: bytes, conn) -> None:  # type: ignore[no-untyped-def]
    """One trainer rank on host A (a spawned child of the driver: same namespaces)."""
    set_run_secret(secret)
    inbox = Inbox()
    conn.send((inbox.for_peer(host_id()).address, host_id()))  # what TP peers here send to
    senders: dict[str, Sender] = {}
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "lead":
            _, replica, ctls, producer_host, peers = cmd
            recv = inbox.for_peer(producer_host)
            for a in [*ctls.values(), *peers]:
                if a not in senders:
                    senders[a] = open_sender(a)

            def ask(op: FetchOp, reply: str, ctls: dict[str, str] = ctls) -> None:
                senders[ctls[op.shard]].send(json.dumps({
                    "ids": list(op.sample_ids), "columns": list(op.columns), "reply": reply,
                }).encode(), [])

            async def request(op: FetchOp, reply: str, ask: Callable[..., None] = ask) -> None:
                await asyncio.to_thread(ask, op, reply)

            t = time.perf_counter()
            batch, frames = asyncio.run(gather_replica(replica, recv, request, timeout_s=TIMEOUT_S))
            fetch_s = time.perf_counter() - t
            forward(frames, [senders[p] for p in peers])
            n = _check(batch, replica.sample_ids)
            for f in frames:
                f.release()
            for p in peers:
                wait = getattr(senders[p], "wait_released", None)
                if wait is not None:
                    wait(TIMEOUT_S)
            conn.send((n, inbox.kind_for(producer_host), fetch_s))
        else:  # "follow": the leader's frames
            batch, frames = receive_replica(inbox.for_peer(host_id()), cmd[2], timeout_s=TIMEOUT_S)
            n = _check(batch, cmd[1])
            for f in frames:
                f.release()
            conn.send((n, None, 0.0))
    inbox.close()


def role_dec_driver() -> None:
    """On host A: plan the step, time `reps` + 1 decentralized steps (the first is warm-up)."""
    cfg = role_config()
    layout = Layout(dp=2, tp=2)
    cons = []
    for _ in range(layout.world_size):
        a, b = CTX.Pipe()
        p = CTX.Process(target=_consumer, args=(bytes.fromhex(cfg["secret"]), b), daemon=True)
        p.start()
        cons.append((p, a))
    try:
        hellos = [conn.recv() for _, conn in cons]
        addrs = [h[0] for h in hellos]
        assert len({h[1] for h in hellos}) == 1 and hellos[0][1] == host_id()
        prods = cfg["producers"]
        producer_host = prods[0]["host"]
        assert all(p["host"] == producer_host for p in prods) and producer_host != host_id()
        infos = [SampleInfo(**i) for p in prods for i in p["infos"]]
        ctls = {p["infos"][0]["shard"]: p["ctl"] for p in prods}
        _, plan, nbytes = plan_all(infos, layout)  # metadata only
        rss0 = _peak_rss_mb()
        _reset_peak_rss()
        kinds: set[str] = set()
        fetches: list[float] = []

        def step() -> float:
            t = time.perf_counter()
            for rep in plan.replicas:
                peers = [r for r in rep.ranks if r != rep.leader]
                cons[rep.leader][1].send(("lead", rep, ctls, producer_host,
                                          [addrs[p] for p in peers]))
                for p in peers:
                    cons[p][1].send(("follow", rep.sample_ids, len(rep.fetches)))
            got, fetch = 0, 0.0
            for _, conn in cons:
                n, kind, fetch_s = conn.recv()
                got, fetch = got + n, max(fetch, fetch_s)
                if kind is not None:
                    kinds.add(kind)
            fetches.append(fetch)
            assert got == 2 * nbytes, (got, nbytes)  # each DP half read by both of its TP ranks
            return time.perf_counter() - t

        times = [step() for _ in range(cfg["reps"] + 1)][1:]
        (kind,) = kinds
        emit({"times": times, "fetch_s": fetches[1:], "bytes": nbytes, "samples": len(infos), "transport": kind,
               "tp_transport": addrs[0].split("://", 1)[0], "bytes_checked": 2 * nbytes,
               "rss_idle_MB": rss0, "rss_MB": _peak_rss_mb()})
    finally:
        for _, conn in cons:
            conn.send(("stop",))
        for p, _ in cons:
            p.join(20)
            if p.is_alive():
                p.kill()


# -- single controller: a Ray driver on A gathers, concatenates, splits and scatters ----------


def role_sc_driver() -> None:
    """On host A, inside the Ray cluster (RAY_ADDRESS set): time `reps` + 1 steps."""
    cfg = role_config()
    import ray

    ray.init(log_to_driver=False, configure_logging=False)
    n, reps = cfg["n"], cfg["reps"]
    spec = {c: np.dtype(dt).str for c, (dt, _) in _FILL.items()}
    words = {c: _WORDS.get(c) for c in COLUMNS}
    on_a, on_b = cfg["resource_a"], cfg["resource_b"]

    @ray.remote(num_cpus=0)
    class Producer:
        """Samples [first, first + n) as one 2-D array per column, in B's object store."""

        def __init__(self, first: int, n: int, copies: int) -> None:
            cols = {}
            for c, dt in spec.items():
                a = np.empty((n, SEQ_LEN), dt)
                for j in range(n):
                    v = _FILL[c][1]
                    a[j] = first + j if v is None else v
                cols[c] = a
            self.refs = [ray.put(cols) for _ in range(copies)]  # zero-copy numpy in the store

        def batch(self, i: int) -> list[Any]:
            return [self.refs[i]]  # wrapped: the caller gets the ref, not the bytes

        def node(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

    @ray.remote(num_cpus=0)
    class Consumer:
        def consume(self, refs: list[Any], first: int, n: int) -> int:
            cols = ray.get(refs[0])  # zero-copy views of A's object store
            nbytes = 0
            for c, a in cols.items():
                assert a.dtype.str == spec[c] and a.shape == (n, SEQ_LEN)
                got = int(a.reshape(-1).view(np.uint64).sum())
                w = words[c]
                want = SEQ_LEN * sum(range(first, first + n)) if w is None else w * (a.nbytes // 8)
                assert got % (1 << 64) == want % (1 << 64), "a consumer read corrupted experience"
                nbytes += a.nbytes
            return nbytes

    half = n // 2
    prods = [Producer.options(resources={on_b: 1}).remote(k * half, half, reps + 1)
             for k in range(2)]
    layout = Layout(dp=2, tp=2)
    cons = [Consumer.options(resources={on_a: 1}).remote() for _ in range(layout.world_size)]
    ray.get([p.batch.remote(0) for p in prods] + [c.__ray_ready__.remote() for c in cons])
    where = ray.get([p.node.remote() for p in prods])
    assert ray.get_runtime_context().get_node_id() not in where  # the bytes really are on B
    nbytes = n * SEQ_LEN * BYTES_PER_TOKEN
    warm = {c: np.empty((n, SEQ_LEN), dt) for c, dt in spec.items()}
    rss0 = _peak_rss_mb()
    _reset_peak_rss()

    def step(i: int) -> float:
        t = time.perf_counter()
        refs = [r[0] for r in ray.get([p.batch.remote(i) for p in prods])]
        parts = ray.get(refs)  # pulled from B's object store into A's, zero-copy views
        cat = {c: np.concatenate([p[c] for p in parts], out=warm[c]) for c in COLUMNS}
        per_dp = [ray.put({c: a[d * half:(d + 1) * half] for c, a in cat.items()})
                  for d in range(layout.dp)]
        got = ray.get([cons[r].consume.remote([per_dp[layout.coord(r).dp]],
                                              layout.coord(r).dp * half, half)
                       for r in range(layout.world_size)])
        assert sum(got) == 2 * nbytes, (got, nbytes)
        del parts, refs, per_dp
        return time.perf_counter() - t

    times = [step(i) for i in range(reps + 1)][1:]
    emit({"times": times, "bytes": nbytes, "bytes_checked": 2 * nbytes,
           "rss_idle_MB": rss0, "rss_MB": _peak_rss_mb()})
    ray.shutdown()


# -- orchestration, in the bench's own process --------------------------------------------------

_ROLES = {"producer": role_producer, "dec-driver": role_dec_driver, "sc-driver": role_sc_driver,
          "tcp-recv": role_tcp_recv, "tcp-send": role_tcp_send}


def _start(host: Any, role: str, cfg: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    p = host.popen([sys.executable, __file__, role], env=env, cwd=str(ROOT),
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdin.write(json.dumps(cfg) + "\n")
    p.stdin.flush()
    return p  # type: ignore[no-any-return]


def _answer(p: subprocess.Popen[str], what: str) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"cross-host {what} exited ({p.wait(30)}) without an answer; "
                           "see its stderr above")
    return json.loads(line)  # type: ignore[no-any-return]


def _finish(p: subprocess.Popen[str], what: str) -> dict[str, Any]:
    out = _answer(p, what)
    if p.wait(60) != 0:
        raise RuntimeError(f"cross-host {what} failed ({p.returncode})")
    return out


def _stats(times: list[float]) -> dict[str, object]:
    return {"median": round(statistics.median(times), 4), "min": round(min(times), 4),
            "max": round(max(times), 4), "reps": [round(t, 4) for t in times]}


def cross_host_bench(total_bytes: int, reps: int, log: Callable[[str], None]) -> dict[str, object]:
    """Both modes on two namespace hosts, in one run; the ``cross_host`` figures."""
    sys.path.insert(0, str(ROOT))  # tests/hosts.py, by the repository root
    from tests.hosts import hosts, ray_cluster, unavailable

    why = unavailable()
    if why is not None:
        return {"skipped": why}
    n = samples_for(total_bytes)
    nbytes = n * SEQ_LEN * BYTES_PER_TOKEN
    secret = os.urandom(32).hex()  # the run's secret: every cross-host frame is HMAC'd under it
    t0 = time.perf_counter()
    with hosts(3, "ehd") as (a, b, c):
        env_a = {**os.environ, ENV_ADDRESS: a.address}
        env_b = {**os.environ, ENV_ADDRESS: b.address}
        base = {"secret": secret, "reps": reps}
        recv = _start(a, "tcp-recv", {**base, "address": a.address, "bytes": nbytes}, env_a)
        port = _answer(recv, "tcp receiver")["port"]
        send = _start(b, "tcp-send", {**base, "address": a.address, "port": port,
                                      "bytes": nbytes}, env_b)
        tcp = _finish(recv, "tcp receiver")["times"]
        send.wait(30)
        log(f"cross-host tcp: {nbytes / statistics.median(tcp) / 1e9:.2f} GB/s "
            f"({time.perf_counter() - t0:.1f} s)")

        prods = [_start(b, "producer", {**base, "name": f"w{k}", "first": k * n // 2,
                                        "n": n // 2}, env_b) for k in range(2)]
        ready = [_answer(p, f"producer w{k}") for k, p in enumerate(prods)]
        dec = _finish(_start(a, "dec-driver", {**base, "producers": ready}, env_a), "dec-driver")
        for p in prods:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(30)
        log(f"cross-host decentralized: {statistics.median(dec['times']):.3f} s "
            f"({time.perf_counter() - t0:.1f} s)")

        with ray_cluster([a, b]) as cluster:
            sc = _finish(_start(a, "sc-driver", {
                **base, "n": n, "resource_a": a.resource, "resource_b": b.resource,
            }, {**cluster.env, ENV_ADDRESS: a.address}), "sc-driver")
        log(f"cross-host single controller: {statistics.median(sc['times']):.3f} s "
            f"({time.perf_counter() - t0:.1f} s)")
        with ray_cluster([c, a, b]) as cluster:  # the head, and the driver, on C
            own = _finish(_start(c, "sc-driver", {
                **base, "n": n, "resource_a": a.resource, "resource_b": b.resource,
            }, {**cluster.env, ENV_ADDRESS: c.address}), "sc-driver on its own host")
        log(f"cross-host single controller, driver on its own host: "
            f"{statistics.median(own['times']):.3f} s ({time.perf_counter() - t0:.1f} s)")
    assert dec["bytes"] == sc["bytes"] == nbytes
    d, s = statistics.median(dec["times"]), statistics.median(sc["times"])
    o = statistics.median(own["times"])
    return {
        "bytes": dec["bytes"], "samples": n, "seq_len": SEQ_LEN, "producers": 2,
        "layout": "DP=2xTP=2",
        "hosts": {"producers": b.address, "trainer": a.address, "own_driver": c.address},
        "bytes_checked": {"decentralized": dec["bytes_checked"],
                          "single_controller": sc["bytes_checked"]},
        "transport": dec["transport"], "tp_transport": dec["tp_transport"],
        "decentralized_s": round(d, 4), "single_controller_s": round(s, 4),
        "speedup": round(s / d, 2),
        "single_controller_own_host_s": round(o, 4), "speedup_own_host": round(o / d, 2),
        "single_controller_own_host": _stats(own["times"]),
        "decentralized": _stats(dec["times"]), "single_controller": _stats(sc["times"]),
        # of decentralized_s: the slower DP leader's fetch from B (the rest: shm to its TP peer,
        # checksums)
        "decentralized_fetch_s": round(statistics.median(dec["fetch_s"]), 4),
        "driver_peak_rss_MB": {
            "decentralized": {"idle": round(dec["rss_idle_MB"], 1), "run": round(dec["rss_MB"], 1)},
            "single_controller": {"idle": round(sc["rss_idle_MB"], 1),
                                  "run": round(sc["rss_MB"], 1)}},
        "tcp_GBps": round(nbytes / statistics.median(tcp) / 1e9, 3),
        "tcp_bytes": nbytes, "tcp": _stats(tcp),
        "mac_GBps": round(mac_gbps(), 3),
    }


if __name__ == "__main__":
    _ROLES[sys.argv[1]]()
