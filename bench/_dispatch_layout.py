"""The layout case of bench/dispatch.py: experience held by 2 producer warehouses, consumed by
a DP=2 x TP=2 group, by the dispatcher's plan and by an emulated single controller (see
bench/dispatch.py's docstring for what each figure means), and what the cases share: the six
experience columns, their bytes per token, the fill every consumer verifies, `checksum`.

Its producers and consumers run as spawned processes (`CTX`); bench/_cross_host.py reuses the
columns, the fill and the checks across two hosts.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zmq

from earl.runtime.dispatch import (
    DispatchPlan,
    FetchOp,
    forward,
    gather_replica,
    plan_step,
    receive_replica,
    replicate,
)
from earl.runtime.dock_index import DockIndex, Lease, SampleInfo
from earl.runtime.dock_warehouse import Warehouse, unpack_batch
from earl.runtime.layout import FixedCount, Layout
from earl.runtime.transport import connect, get_transport
from earl.runtime.transport.shm_arena import ShmArena

CTX = mp.get_context("spawn")
COLUMNS = ("input_ids", "loss_mask", "rollout_logprobs", "ref_logprobs", "advantages", "versions")
BYTES_PER_TOKEN = 8 + 1 + 4 + 4 + 4 + 4


def checksum(buf) -> int:  # type: ignore[no-untyped-def]
    """Sum of `buf` read as little-endian uint64 words, plus any tail bytes, mod 2**64.

    One read pass over every byte, at memory speed (a consumer's cheapest full touch).
    """
    nbytes = memoryview(buf).nbytes
    if nbytes % 8 == 0:
        return int(np.frombuffer(buf, np.uint64).sum())
    words = np.frombuffer(buf, np.uint8)
    head = nbytes // 8 * 8
    return (int(words[:head].view(np.uint64).sum()) + int(words[head:].sum())) % (1 << 64)


# -- layout: 2 producers -> DP=2 x TP=2 -----------------------------------------------------------


def _producer(name: str, n: int, seq_len: int, first: int, conn) -> None:
    """A warehouse shard answering fetch requests (the RPC a warehouse actor serves)."""
    wh = Warehouse(name, arena=ShmArena())  # experience in shared memory from put on
    for i in range(first, first + n):
        sid = f"s{i}"
        wh.put(sid, {c: np.full(seq_len, x) for c, x in _fill(sid).items()},
               group_id=f"g{i}")
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    ctl = f"ipc://{tempfile.mkdtemp(prefix='earl-bench-')}/p"
    sock.bind(ctl)
    conn.send((ctl, [info for info, _ in wh.report()[0]]))
    senders = {}
    while True:
        ident, req = sock.recv_multipart()
        msg = json.loads(req)
        if msg["op"] == "stop":
            break
        addr = msg["reply"]
        if addr not in senders:
            senders[addr] = connect(addr)
        header, bufs = wh.pack(msg["ids"], msg["columns"])
        senders[addr].send(header, bufs)
        sock.send_multipart([ident, b"ok"])
    for s in senders.values():
        s.close()


def _request(ctl: str, op: FetchOp, reply: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(ctl)
    sock.send(json.dumps({"op": "send", "ids": list(op.sample_ids), "columns": list(op.columns),
                          "reply": reply}).encode())
    assert sock.recv() == b"ok"
    sock.close(0)


_FILL = {"input_ids": (np.int64, None), "loss_mask": (np.int8, 1),
         "rollout_logprobs": (np.float32, -1.25), "ref_logprobs": (np.float32, -0.5),
         "advantages": (np.float32, 1.0), "versions": (np.int32, 3)}


def _fill(sid: str) -> dict[str, np.ndarray]:
    """One element of the constant each column of sample `sid` holds (what producers write)."""
    return {c: np.array(int(sid[1:]) if v is None else v, dt) for c, (dt, v) in _FILL.items()}


def _word(x: np.ndarray) -> int:
    """The uint64 word made of repeats of scalar `x`."""
    return int(np.full(8 // x.itemsize, x, x.dtype).view(np.uint64)[0])


_WORDS = {c: _word(np.array(v, dt)) for c, (dt, v) in _FILL.items() if v is not None}


def _check(batch, ids) -> int:  # type: ignore[no-untyped-def]
    """What a trainer would notice: every sample there, every byte read and intact."""
    assert len(batch) == len(ids)
    nbytes = got = want = 0
    for sid in ids:
        for col, a in batch[sid].items():
            assert a.dtype == _FILL[col][0] and a.nbytes % 8 == 0
            got += checksum(a)
            want += _WORDS.get(col, int(sid[1:])) * (a.nbytes // 8)
            nbytes += a.nbytes
    assert got % (1 << 64) == want % (1 << 64), "a consumer read corrupted experience"
    return nbytes


def _consumer(rank: int, conn) -> None:
    recv = get_transport("shm").listen()
    conn.send(recv.address)
    senders = {}
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "lead":  # decentralized: fetch my replica's slice, replicate to peers
            _, replica, ctls, peers = cmd

            async def request(op: FetchOp, reply: str, ctls: dict = ctls) -> None:
                await asyncio.to_thread(_request, ctls[op.shard], op, reply)

            batch, frames = asyncio.run(gather_replica(replica, recv, request))
            for p in peers:
                senders.setdefault(p, connect(p))
            forward(frames, [senders[p] for p in peers])  # same pages, no copy
            n = _check(batch, replica.sample_ids)
            for f in frames:
                f.release()
            for p in peers:  # the replica is done when its peers have read their share
                senders[p].wait_released(120)
        else:  # "follow": frames from the leader or the driver
            batch, frames = receive_replica(recv, cmd[2], timeout_s=120)
            n = _check(batch, cmd[1])
            for f in frames:
                f.release()
        conn.send(n)
    recv.close()


def plan_all(infos: list[SampleInfo], layout: Layout) -> tuple[Lease, DispatchPlan, int]:
    """The lease of every sample of `infos` for one step, the dispatcher's plan of it (metadata
    only, as the driver holds it), and the experience's bytes."""
    index = DockIndex(stages=["train"], capacity=len(infos))
    for info in infos:
        index.register(info)
    lease = index.take("train", list(COLUMNS), len(infos), whole_groups=False)
    plan = plan_step(lease, layout, FixedCount(micro_batch_size=1))
    return lease, plan, sum(sum(i.columns.values()) for i in infos)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
        f.write("5")


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _layout_child(total_bytes: int, reps: int, conn) -> None:
    conn.send(_layout_bench(total_bytes, reps))


def layout_bench(total_bytes: int, reps: int) -> dict[str, object]:
    """Run in a fresh driver process, so its peak RSS is this run's alone."""
    parent, child_end = CTX.Pipe()
    p = CTX.Process(target=_layout_child, args=(total_bytes, reps, child_end))
    p.start()
    try:
        if not parent.poll(600):
            raise TimeoutError("layout benchmark did not finish in 600 s")
        return parent.recv()  # type: ignore[no-any-return]
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()


def _layout_bench(total_bytes: int, reps: int, seq_len: int = 32768) -> dict[str, object]:
    n = max(8, total_bytes // (seq_len * BYTES_PER_TOKEN) // 8 * 8)
    layout = Layout(dp=2, tp=2)
    prods, cons = [], []
    shard_ctl: dict[str, str] = {}
    try:
        for k in range(2):
            a, b = CTX.Pipe()
            p = CTX.Process(target=_producer, args=(f"w{k}", n // 2, seq_len, k * n // 2, b))
            p.start()
            prods.append((p, a))
        for r in range(layout.world_size):
            a, b = CTX.Pipe()
            p = CTX.Process(target=_consumer, args=(r, a))
            p.start()
            cons.append((p, b))
        infos = []
        for k, (_, conn) in enumerate(prods):
            ctl, inf = conn.recv()
            shard_ctl[f"w{k}"] = ctl
            infos += inf
        addrs = [conn.recv() for _, conn in cons]
        lease, plan, nbytes = plan_all(infos, layout)
        rss0 = _peak_rss_mb()
        _reset_peak_rss()

        def decentralized() -> float:
            t = time.perf_counter()
            for rep in plan.replicas:
                leader, peers = rep.leader, [r for r in rep.ranks if r != rep.leader]
                cons[leader][1].send(("lead", rep, shard_ctl, [addrs[p] for p in peers]))
                for p in peers:
                    cons[p][1].send(("follow", rep.sample_ids, len(rep.fetches)))
            got = sum(conn.recv() for _, conn in cons)
            assert got == 2 * nbytes
            return time.perf_counter() - t

        dec = [decentralized() for _ in range(reps + 1)][1:]
        rss_dec = _peak_rss_mb()
        _reset_peak_rss()

        recv = get_transport("shm").listen()
        senders = [connect(a) for a in addrs]
        gather: dict[str, np.ndarray] = {}

        def single_controller() -> float:
            t = time.perf_counter()
            with ThreadPoolExecutor(len(shard_ctl)) as pool:  # 1) gather all to the driver
                for f in [pool.submit(_request, ctl, FetchOp(shard, tuple(
                        x.sample_id for x in lease.samples if x.columns["input_ids"] == shard
                ), COLUMNS), recv.address) for shard, ctl in shard_ctl.items()]:
                    f.result()
            held: dict[str, dict[str, np.ndarray]] = {}
            for _ in shard_ctl:
                frame = recv.recv(120)
                for sid, cols in unpack_batch(frame).items():
                    held[sid] = {}
                    for c, a in cols.items():  # materialize in driver memory (warm buffers)
                        buf = gather.get(f"{sid}/{c}")
                        if buf is None:
                            buf = gather[f"{sid}/{c}"] = np.empty_like(a)
                        np.copyto(buf, a)
                        held[sid][c] = buf
                frame.release()
            for rep in plan.replicas:  # 2) scatter each DP slice to every rank of its replica
                batch = {sid: held[sid] for sid in rep.sample_ids}
                for r in rep.ranks:
                    cons[r][1].send(("follow", rep.sample_ids, 1))
                replicate(batch, [senders[r] for r in rep.ranks])
            got = sum(conn.recv() for _, conn in cons)
            assert got == 2 * nbytes
            return time.perf_counter() - t

        sc = [single_controller() for _ in range(reps + 1)][1:]
        rss_sc = _peak_rss_mb()
        for s in senders:
            s.close()
        recv.close()
        d, s = statistics.median(dec), statistics.median(sc)
        return {
            "bytes": nbytes, "samples": len(infos), "seq_len": seq_len,
            "producers": 2, "layout": "DP=2xTP=2",
            "decentralized_s": round(d, 4), "single_controller_s": round(s, 4),
            "speedup": round(s / d, 2),
            "decentralized_s_reps": [round(x, 4) for x in dec],
            "single_controller_s_reps": [round(x, 4) for x in sc],
            # the driver's peak RSS: after start-up and planning, during each mode's runs
            "driver_peak_rss_MB": {"idle": round(rss0, 1), "decentralized": round(rss_dec, 1),
                                   "single_controller": round(rss_sc, 1)},
            "transport": "shm",
        }
    finally:
        for _, conn in cons:
            conn.send(("stop",))
        for ctl in shard_ctl.values():
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.connect(ctl)
            sock.send(b'{"op": "stop"}')
            sock.close(100)
        for p, _ in prods + cons:
            p.join(20)
            if p.is_alive():
                p.kill()
