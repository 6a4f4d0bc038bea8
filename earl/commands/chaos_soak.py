"""`earl chaos --soak MINUTES`: a long run with a fault every `--every-s` seconds, each drawn
(with replacement) from the faults `--draw` draws from, and the run's resources sampled over
time: each actor's resident memory (RSS, and USS: its private pages, without the shared memory
of the dock's arenas, whose pages a 16 MiB segment touches one by one as it fills), the run
folder's size by part, the steps trained.

What it reports (the chaos report's `soak`): per actor, RSS and USS growth after warm-up (the
median of the samples in the last 10 minutes over the median in the 10 minutes after warm-up,
an actor's restarts included: the same name and rank is one actor); the run folder's size at
warm-up and at the end, by top-level part (`folder_growth`: each part, the trajectory dump's
segments as one, with its KiB per step trained since warm-up; the checkpoint's with its critic
tables' fill and the size they reach full, `earl.commands.critic_fill`); steps/s per 10-minute
window. Not here: firing the faults (`earl.commands.chaos_injector`) and the oracle
(`earl.commands.chaos_oracle`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from earl.commands import critic_fill as fill
from earl.commands.chaos_draw import DRAWN
from earl.observe import tree_rss_mib

__all__ = ["GROUPS", "Sampler", "schedule", "summarize"]

GROUPS = ("rollout", "producer", "reference", "dock", "trainer")
WARMUP_S = 600.0  # RSS growth is measured after this
WINDOW_S = 600.0  # the windows whose medians are compared, and steps/s is averaged over


def schedule(minutes: float, every_s: float, seed: int) -> tuple[list[str], list[float]]:
    """Faults drawn with replacement from `DRAWN` and when each is due (seconds from the first
    step): one per `every_s`, each at +-20% of its slot; none in the last slot, so the run
    shows it recovered from the last one."""
    rng = random.Random(seed)
    n = max(int(minutes * 60 / every_s) - 1, 1)
    faults = [rng.choice(DRAWN) for _ in range(n)]
    due = [round(every_s * (i + 1 + rng.uniform(-0.2, 0.2)), 1) for i in range(n)]
    return faults, due


def _folder_mib(root: Path) -> dict[str, float]:
    """Size of each top-level entry of `root` (a folder summed), in MiB."""
    out: dict[str, float] = {}
    for entry in root.iterdir() if root.is_dir() else ():
        try:
            files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
            out[entry.name] = round(sum(p.stat().st_size for p in files) / 2**20, 2)
        except OSError:  # a file rotated away while summed
            continue
    return out


def _census() -> Counter[str]:
    """The driver's live objects (those the collector tracks), by type."""
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


class Sampler:
    """Samples the run every `every_s` seconds into `rows`: seconds since start, steps trained,
    RSS per actor (`name[rank]`, and `driver`: this process alone), the folder's size, the
    driver's live objects. After each rewind, `rewinds` gets the driver's RSS and the types
    whose live objects grew most since the one before (what an attempt may leave behind)."""

    def __init__(self, rt: Any, job: Any, out: Path, every_s: float = 30.0) -> None:
        self.rt, self.job, self.out, self.every_s = rt, job, out, every_s
        self.rows: list[dict[str, Any]] = []
        self.rewinds: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self._seen_rewinds = 0
        self._census: Counter[str] | None = None

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.every_s)

    async def sample(self) -> None:
        import psutil

        me = psutil.Process(os.getpid()).memory_full_info()
        rss = {"driver": round(me.rss / 2**20, 1)}
        uss = {"driver": round(me.uss / 2**20, 1)}
        for name in GROUPS:
            rec = await self.rt.dir_call("lookup", name)
            for rank, pid in enumerate(rec.pids if rec is not None else []):
                if pid:
                    rss[f"{name}[{rank}]"] = round(tree_rss_mib(pid), 1)
                    uss[f"{name}[{rank}]"] = round(
                        await asyncio.to_thread(tree_rss_mib, pid, private=True), 1)
        folder = await asyncio.to_thread(_folder_mib, self.out)
        census = _census()
        t = round(time.perf_counter() - self.t0, 1)
        row = {"t": t, "step": self.job.state.step if self.job.started else 0,
               "rss_mib": rss, "uss_mib": uss, "folder_mib": folder,
               "driver_objects": sum(census.values())}
        # the first sample after warm-up (rows are in time order), then every ~10 samples
        warm = t >= WARMUP_S > (self.rows[-1]["t"] if self.rows else -1.0)
        if warm or len(self.rows) % 10 == 0:
            row["critic"] = await _critic_fill_apart(self.out)
        self.rows.append(row)
        if self._census is None or self.job.supervisor.rewinds > self._seen_rewinds:
            if self._census is not None:
                grew = sorted(((k, n - self._census[k]) for k, n in census.items()
                               if n > self._census[k]), key=lambda kv: -kv[1])
                self.rewinds.append({"t": t, "rewinds": self.job.supervisor.rewinds,
                                     "driver_rss_mib": rss["driver"],
                                     "objects_grew": dict(grew[:15])})
            self._census, self._seen_rewinds = census, self.job.supervisor.rewinds


async def _critic_fill_apart(root: Path) -> dict[str, float] | None:
    """`critic_fill` in a child process: parsing the critic's JSON (MBs, growing as its tables
    fill) in the driver would leave its heap fragmented, and the driver is one of the
    processes whose memory the soak measures."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", fill.__file__, str(root), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    try:
        got = json.loads(out or b"null")
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def _median(rows: list[dict[str, Any]], key: str, kind: str = "rss_mib") -> float | None:
    vals = [r[kind][key] for r in rows if r.get(kind, {}).get(key)]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS growth per actor after warm-up, folder size at warm-up and at the end, and steps/s
    per window (see the module's docstring)."""
    if not rows:
        return {"samples": 0}
    end = rows[-1]["t"]
    early = [r for r in rows if WARMUP_S <= r["t"] < WARMUP_S + WINDOW_S]
    late = [r for r in rows if r["t"] >= max(end - WINDOW_S, WARMUP_S + WINDOW_S)]
    growth: dict[str, Any] = {}
    for key in sorted({k for r in rows for k in r["rss_mib"]}):
        a, b = _median(early, key), _median(late, key)
        pa, pb = _median(early, key, "uss_mib"), _median(late, key, "uss_mib")
        growth[key] = {"after_warmup_mib": a, "end_mib": b,
                       "growth": round(b / a - 1, 4) if a and b else None,
                       "uss_after_warmup_mib": pa, "uss_end_mib": pb,
                       "uss_growth": round(pb / pa - 1, 4) if pa and pb else None}
    warm = next((r for r in rows if r["t"] >= WARMUP_S), rows[0])
    steps_per_s = []
    t = 0.0
    while t < end:
        w = [r for r in rows if t <= r["t"] <= t + WINDOW_S]
        if len(w) >= 2 and w[-1]["t"] > w[0]["t"]:
            steps_per_s.append({"from_s": t, "steps_per_s": round(
                (w[-1]["step"] - w[0]["step"]) / (w[-1]["t"] - w[0]["t"]), 3)})
        t += WINDOW_S
    total = lambda r: round(sum(r["folder_mib"].values()), 2)
    steps = max(rows[-1]["step"] - warm["step"], 1)
    parts: dict[str, dict[str, Any]] = {}
    for name in sorted(rows[-1]["folder_mib"]):
        key = "trajectories" if name.startswith("trajectories") else name
        part = parts.setdefault(key, {"after_warmup_mib": 0.0, "end_mib": 0.0})
        part["after_warmup_mib"] += warm["folder_mib"].get(name, 0.0)
        part["end_mib"] += rows[-1]["folder_mib"][name]
    critic = [r for r in rows if r.get("critic")]
    if critic:  # the checkpoint's critic tables: at warm-up, at the end, and their bound
        early_c = next((r for r in critic if r["t"] >= warm["t"]), critic[0])["critic"]
        parts.setdefault("checkpoint", {"after_warmup_mib": 0.0, "end_mib": 0.0})["critic"] = {
            "after_warmup": early_c, "end": critic[-1]["critic"]}
    for part in parts.values():
        part["kib_per_step"] = round((part["end_mib"] - part["after_warmup_mib"]) * 1024 / steps, 3)
    vals = [g["growth"] for g in growth.values() if g["growth"] is not None]
    uss = [g["uss_growth"] for g in growth.values() if g["uss_growth"] is not None]
    return {"samples": len(rows), "seconds": end, "warmup_s": WARMUP_S, "window_s": WINDOW_S,
            "rss": growth, "max_rss_growth": max(vals) if vals else None,
            "max_uss_growth": max(uss) if uss else None,
            "folder_mib_after_warmup": total(warm), "folder_mib_end": total(rows[-1]),
            "folder_mib_end_by_part": rows[-1]["folder_mib"], "folder_growth": parts,
            "folder_mib_max": max(total(r) for r in rows), "steps_per_s": steps_per_s}
