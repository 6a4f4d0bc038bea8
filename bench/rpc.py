"""RPC benchmark: earl actors vs Ray actors vs pyzmq vs a raw unix socket, same machine, same run.

    python bench/rpc.py --json [--quick]

Prints one JSON object: earl round-trip latency (median, p99) and pipelined calls/s to a
one-actor group, the same for Ray 2.x actors (null if Ray is not importable), a pyzmq asyncio
DEALER/ROUTER echo (the ZeroMQ design we did not take), and a raw unix-socket ping-pong between
two processes (the physical floor for any RPC here). Payload: one small int each way.
It also reports the CPU time each side spends per pipelined call (`caller_cpu_us_per_call`,
`actor_cpu_us_per_call`) and the rate that implies on two idle cores (`calls_per_s_cpu_bound`),
which stays meaningful when other jobs share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _results

from earl.runtime import Actor, Runtime, endpoint


class Echo(Actor):
    @endpoint
    async def ping(self, x: int) -> int:
        return x


def _summary(samples_s: list[float]) -> tuple[float, float]:
    xs = sorted(samples_s)
    return statistics.median(xs) * 1e6, xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6


# ---- earl ----------------------------------------------------------------------------------
async def _earl(n_rtt: int, n_pipe: int, window: int) -> dict[str, float]:
    async with Runtime() as rt:
        g = await rt.spawn("echo", Echo)
        h = g[0]
        for i in range(500):
            await h.ping.call_one(i)
        lat = []
        for i in range(n_rtt):
            t = time.perf_counter()
            await h.ping.call_one(i)
            lat.append(time.perf_counter() - t)
        med, p99 = _summary(lat)
        import psutil

        actor = psutil.Process((await rt.dir_call("lookup", "echo")).pids[0])
        me = psutil.Process()
        rates = []
        cpu_me0, cpu_actor0 = me.cpu_times(), actor.cpu_times()
        for _ in range(3):  # median of 3 rounds: the machine may be shared
            t = time.perf_counter()
            for start in range(0, n_pipe, window):  # `window` calls in flight, in order
                ping = h.ping
                futs = [ping.call_one(i) for i in range(start, start + window)]
                for f in futs:
                    await f
            rates.append(n_pipe / (time.perf_counter() - t))
        cpu_me1, cpu_actor1 = me.cpu_times(), actor.cpu_times()
    # CPU seconds per call on each side: what the rate would be on two idle cores
    caller = (cpu_me1.user + cpu_me1.system - cpu_me0.user - cpu_me0.system) / (3 * n_pipe)
    callee = (cpu_actor1.user + cpu_actor1.system - cpu_actor0.user - cpu_actor0.system) / (
        3 * n_pipe)
    return {"rtt_us_median": med, "rtt_us_p99": p99,
            "calls_per_s_pipelined": statistics.median(rates),
            "caller_cpu_us_per_call": caller * 1e6, "actor_cpu_us_per_call": callee * 1e6,
            "calls_per_s_cpu_bound": 1.0 / max(caller, callee, 1e-9)}


# ---- raw unix socket floor -------------------------------------------------------------------
_ECHO = "import socket,sys\ns=socket.socket(fileno=int(sys.argv[1]))\n" \
        "while True:\n d=s.recv(64)\n if not d: break\n s.sendall(d)\n"


def _unix_floor(n: int) -> float:
    a, b = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", _ECHO, str(b.fileno())], pass_fds=(b.fileno(),))
    b.close()
    msg = b"x" * 32
    lat = []
    for i in range(n + 200):
        t = time.perf_counter()
        a.sendall(msg)
        a.recv(64)
        if i >= 200:
            lat.append(time.perf_counter() - t)
    a.close()
    p.wait()
    return _summary(lat)[0]


# ---- pyzmq DEALER/ROUTER ---------------------------------------------------------------------
_ZMQ_SERVER = """
import asyncio, sys, uvloop, zmq, zmq.asyncio
async def main():
    ctx = zmq.asyncio.Context(); s = ctx.socket(zmq.ROUTER); s.bind(sys.argv[1])
    while True:
        frames = await s.recv_multipart()
        if frames[-1] == b"stop": break
        await s.send_multipart(frames)
uvloop.run(main())
"""


async def _zmq(n: int) -> float | None:
    try:
        import zmq
        import zmq.asyncio
    except ImportError:
        return None
    path = f"ipc://{tempfile.gettempdir()}/earl-bench-{os.getpid()}.zmq"
    p = subprocess.Popen([sys.executable, "-c", _ZMQ_SERVER, path])  # noqa: ASYNC220
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(path)
    try:
        lat = []
        for i in range(n + 200):
            t = time.perf_counter()
            await s.send_multipart([b"", b"%d" % i])
            await s.recv_multipart()
            if i >= 200:
                lat.append(time.perf_counter() - t)
        await s.send_multipart([b"", b"stop"])
    finally:
        s.close(linger=0)
        ctx.term()
        p.wait(timeout=10)
    return _summary(lat)[0]


# ---- Ray -----------------------------------------------------------------------------------
def _ray(n_rtt: int, n_pipe: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {"ray_rtt_us_median": None, "ray_calls_per_s_pipelined": None}
    try:
        import ray
    except ImportError:
        return out
    home = tempfile.mkdtemp(prefix="earl-ray-home-")
    os.environ["HOME"] = home
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=os.path.join(home, "ray"),
             log_to_driver=False, logging_level="ERROR")
    try:
        @ray.remote
        class RayEcho:
            def ping(self, x: int) -> int:
                return x

        a = RayEcho.remote()
        ray.get([a.ping.remote(i) for i in range(200)])
        lat = []
        for i in range(n_rtt):
            t = time.perf_counter()
            ray.get(a.ping.remote(i))
            lat.append(time.perf_counter() - t)
        out["ray_rtt_us_median"] = _summary(lat)[0]
        t = time.perf_counter()
        ray.get([a.ping.remote(i) for i in range(n_pipe)])
        out["ray_calls_per_s_pipelined"] = n_pipe / (time.perf_counter() - t)
    finally:
        ray.shutdown()
    return out


def run(quick: bool, with_ray: bool = True) -> dict[str, Any]:
    import uvloop

    n_rtt, n_pipe = (2000, 10000) if quick else (10000, 50000)
    res: dict[str, Any] = {"bench": "rpc", "quick": quick, "cpus": os.cpu_count()}
    res.update(uvloop.run(_earl(n_rtt, n_pipe, window=1000)))
    res["unix_socket_rtt_us_median"] = _unix_floor(n_rtt)
    res["zmq_dealer_router_rtt_us_median"] = uvloop.run(_zmq(n_rtt))
    res.update({"ray_rtt_us_median": None, "ray_calls_per_s_pipelined": None})
    if with_ray:
        try:
            res.update(_ray(500 if quick else 2000, 5000 if quick else 20000))
        except Exception as e:  # noqa: BLE001 (Ray failing to start must not lose our numbers)
            res["ray_error"] = f"{type(e).__name__}: {e}"
    r, rr = res["rtt_us_median"], res["ray_rtt_us_median"]
    res["rtt_vs_unix_floor"] = r / res["unix_socket_rtt_us_median"]
    res["ray_rtt_over_earl_rtt"] = rr / r if rr else None
    rc = res["ray_calls_per_s_pipelined"]
    res["earl_calls_over_ray_calls"] = res["calls_per_s_pipelined"] / rc if rc else None
    z = res["zmq_dealer_router_rtt_us_median"]
    res["zmq_rtt_over_earl_rtt"] = z / r if z else None
    res["targets_met"] = bool(r <= 80 and res["calls_per_s_pipelined"] >= 40000
                              and (rr is None or rr / r >= 10))
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (< 45 s)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray comparison")
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    res = run(args.quick, with_ray=not args.no_ray)
    if args.save:
        _results.save("rpc", res, quick=args.quick, begun=begun)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>34}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
