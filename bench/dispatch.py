"""Data-plane benchmark: transports vs memcpy and Ray, and decentralized vs single-controller dispatch.

    python bench/dispatch.py --json [--quick]

Prints one JSON object:
- ``memcpy_GBps``: single-thread copy of the transfer size into warm memory, best of reps (the
  physical limit; the transports below report medians, so the ratio is conservative).
- ``transfer_GBps``: {shm, ucx, gloo, zmq} -> 256 MiB from one process to another, measured at
  the receiver from "go" until it has *read every byte* (a uint64 checksum, verified against the
  sender's), median of reps, warm buffers. Every transport pays the same receiver-side read, so
  the figures compare: shm is one copy into the segment plus the consumer's read.
- ``best_transport`` / ``best_vs_memcpy``: the fastest of those, as a fraction of memcpy.
- ``zero_copy_handoff_GBps``: {shm}: the same transfer timed until the receiver holds read-only
  views of the sender's segment, without reading them (a sender-side copy plus one message). Not
  comparable with ``transfer_GBps``; it is what a consumer that reads only part of a frame pays.
- ``ray_put_get_GBps``: ray.put in one actor + ray.get (zero-copy) and the same checksum in
  another (null without ray).
- ``layout``: experience (``bytes``, 1 GiB by default) held by 2 producer warehouses, consumed by a
  DP=2 x TP=2 group; every consumer checksums every byte of its slice inside the timed span.
  The warehouses keep the experience in a shared-memory arena (what `WarehouseHost` does; the
  one copy happens at put, before the timed span), so on one host a fetch sends the place of the
  bytes, not the bytes. ``decentralized_s``: the dispatcher's plan -- each DP leader fetches its
  half straight from the warehouses over shm and forwards it to its TP peer (on one host the peer
  maps the same read-only pages: no copy anywhere). ``single_controller_s``: an emulation of a single controller
  (verl's data path) at its best: the driver gathers everything over shm from the same
  warehouses (zero-copy too), copies it into warm buffers of its own, then scatters each DP half to both TP ranks -- serial copies in one
  process, no serialization (a real single controller also pickles). Driver peak RSS for each.
- ``cross_host`` (``--cross-host``; on in the full run, off with ``--quick``;
  ``--cross-host-only`` runs just it): the layout above across two hosts made from Linux
  namespaces by tests/hosts.py (imported with the repository root put on ``sys.path``):
  ``bytes`` (``--cross-host-mib``, 256) in 2 warehouses on host B, DP=2 x TP=2 on host A.
  ``decentralized_s``: each DP leader fetches its half from B over ``transport``
  (`transport.choose(same_host=False)`, frames authenticated) and forwards it over
  ``tp_transport``;
  ``single_controller_s``: verl's path through a Ray cluster over the two hosts (driver on A
  ``ray.get``s from producer actors on B, concatenates, splits, ``ray.put``s per DP rank);
  ``speedup``; ``single_controller_own_host_s`` and ``speedup_own_host``: the same with the
  driver on a third host; repetitions, ``bytes_checked``, driver RSS, and the caps ``tcp_GBps`` and
  ``mac_GBps``: see bench/_cross_host.py. ``{"skipped": reason}`` where hosts cannot be made.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import _results
import numpy as np
from _dispatch_layout import CTX, checksum, layout_bench
from _machine import memcpy_gbps

from earl.runtime.transport import available, connect, get_transport, pack_arrays

MiB = 1 << 20


# -- point-to-point transports ------------------------------------------------------------------


def _payload(nbytes: int) -> np.ndarray:
    return np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)


def _p2p_sender(address: str, nbytes: int, conn) -> None:
    sender = connect(address)
    payload = _payload(nbytes)
    header, bufs = pack_arrays({"x": payload})
    while conn.recv() == "go":
        sender.send(header, bufs)
    sender.close()


def transfer_gbps(
    name: str, nbytes: int, reps: int, warmup: int = 2, *, touch: bool = True
) -> float | None:
    """Median GB/s from "go" to the receiver having read every byte (or, with ``touch=False``,
    to it holding the frame -- for shm that is a zero-copy mapping nobody has read)."""
    if not available(name):
        return None
    nbytes = nbytes // 8 * 8
    expected = checksum(_payload(nbytes))
    receiver = get_transport(name).listen()
    parent, child_end = CTX.Pipe()
    child = CTX.Process(target=_p2p_sender, args=(receiver.address, nbytes, child_end))
    child.start()
    times = []
    try:
        for i in range(warmup + reps):
            t = time.perf_counter()
            parent.send("go")
            frame = receiver.recv(timeout=120)
            got = sum(checksum(b) for b in frame.buffers) % (1 << 64) if touch else None
            times.append(time.perf_counter() - t)
            assert frame.nbytes == nbytes
            assert got in (None, expected), f"{name}: checksum {got} != {expected}"
            frame.release()
        parent.send("stop")
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
        receiver.close()
    return nbytes / statistics.median(times[warmup:]) / 1e9


def ray_put_get_gbps(nbytes: int, reps: int) -> float | None:
    try:
        import ray
    except ImportError:
        return None
    nbytes = nbytes // 8 * 8
    expected = checksum(_payload(nbytes))
    tmp = tempfile.mkdtemp(prefix="earl-ray-")
    os.environ["HOME"] = tmp  # ray writes ~/.ray
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    try:

        @ray.remote(num_cpus=0)
        class Producer:
            def __init__(self, n: int) -> None:
                self.a = _payload(n)

            def put(self):  # type: ignore[no-untyped-def]
                t = time.time()
                return t, [ray.put(self.a)]

        @ray.remote(num_cpus=0)
        class Consumer:
            def get(self, refs) -> float:  # type: ignore[no-untyped-def]
                x = ray.get(refs[0])
                # numpy inline: a function of another bench module would not pickle to ray
                assert x.nbytes == nbytes
                assert int(np.frombuffer(x, np.uint64).sum()) == expected
                return time.time()

        p, c = Producer.remote(nbytes), Consumer.remote()
        times = []
        for _ in range(reps + 2):
            t0, refs = ray.get(p.put.remote())
            t1 = ray.get(c.get.remote(refs))
            times.append(t1 - t0)
            del refs
        return nbytes / statistics.median(times[2:]) / 1e9
    finally:
        ray.shutdown()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cross_host(args: argparse.Namespace) -> dict[str, object]:
    from _cross_host import cross_host_bench  # makes namespaced hosts: load it only when asked

    return cross_host_bench(args.cross_host_mib * MiB, 3 if args.quick else 5, _log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (default)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 50 s)")
    ap.add_argument("--size-mib", type=int, default=256, help="point-to-point transfer size")
    ap.add_argument("--layout-mib", type=int, default=1024, help="experience for the layout run")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--cross-host", action=argparse.BooleanOptionalAction, default=None,
                    help="run the cross-host case (default: on, off with --quick)")
    ap.add_argument("--cross-host-only", action="store_true", help="run only the cross-host case")
    ap.add_argument("--cross-host-mib", type=int, default=256,
                    help="experience for the cross-host run")
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    reps = 3 if args.quick else 7
    if args.cross_host_only:  # saved under its own name: the one-host figures stay as they are
        out = {"cross_host": _cross_host(args)}
        print(json.dumps(out))
        if args.save:
            _results.save("dispatch_cross_host", out, quick=args.quick, begun=begun)
        return 0
    nbytes = args.size_mib * MiB
    t0 = time.perf_counter()
    out: dict[str, object] = {"size_bytes": nbytes}
    out["memcpy_GBps"] = round(memcpy_gbps(nbytes, reps), 2)
    tr: dict[str, float | None] = {}
    for name in ("shm", "ucx", "gloo", "zmq"):
        v = transfer_gbps(name, nbytes, reps, warmup=1 if args.quick else 2)
        tr[name] = None if v is None else round(v, 2)
        _log(f"{name}: {tr[name]} GB/s ({time.perf_counter() - t0:.1f} s)")
    out["transfer_GBps"] = tr
    zc = transfer_gbps("shm", nbytes, reps, warmup=1 if args.quick else 2, touch=False)
    out["zero_copy_handoff_GBps"] = {"shm": None if zc is None else round(zc, 2)}
    _log(f"shm zero-copy handoff: {zc} GB/s ({time.perf_counter() - t0:.1f} s)")
    best = max((v, k) for k, v in tr.items() if v is not None)
    out["best_transport"] = best[1]
    out["best_vs_memcpy"] = round(best[0] / out["memcpy_GBps"], 3)  # type: ignore[operator]
    rh = None
    if not args.no_ray:
        try:
            rh = ray_put_get_gbps(nbytes, reps)
        except Exception as e:  # noqa: BLE001 -- ray installed but cannot start: report it
            out["ray_error"] = f"{type(e).__name__}: {e}"[:200]
    out["ray_put_get_GBps"] = None if rh is None else round(rh, 2)
    _log(f"ray: {rh} ({time.perf_counter() - t0:.1f} s)")
    out["layout"] = layout_bench(args.layout_mib * MiB, 3 if args.quick else 5)
    if args.cross_host if args.cross_host is not None else not args.quick:
        out["cross_host"] = _cross_host(args)
    out["cpus"] = os.cpu_count()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    if args.save:
        _results.save("dispatch", out, quick=args.quick, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
