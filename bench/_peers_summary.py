"""`bench/peers.py`'s figures from its runs: each side's means over rounds, EARL's ratios to
TRL's best, whether both sides did the same work, and issue 47's goals."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["goals", "mean", "same_work", "versus"]

SAME_WORK = 0.05  # turns and model tokens per trajectory: within 5% of TRL's


def mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of the numeric figures over rounds; spread of trajectories/s; the runs."""
    def m(key: str) -> float:
        return round(statistics.fmean(r[key] for r in runs), 2)

    tps = [r["trajectories_per_s"] for r in runs]
    hits = [r["seconds_to_threshold"] for r in runs]
    return {"trajectories_per_s": m("trajectories_per_s"), "tokens_per_s": m("tokens_per_s"),
            "turns_per_s": round(statistics.fmean(r["trajectories_per_s"] * r["turns_mean"]
                                                  for r in runs), 1),
            "trajectories_per_s_end_to_end": m("trajectories_per_s_end_to_end"),
            "cores_used": m("cores_used"), "trajectories_per_cpu_s": m("trajectories_per_cpu_s"),
            "turns_mean": m("turns_mean"),
            "seconds_to_threshold": None if None in hits else round(statistics.fmean(hits), 1),
            "final_eval": {k: round(statistics.fmean(r["final_eval"][k] for r in runs), 3)
                           for k in ("reward", "accuracy")},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "spread": round((max(tps) - min(tps)) / statistics.fmean(tps), 3),
            **{k: round(statistics.fmean(r[k] for r in runs), 3)  # EARL's own
               for k in ("straggler_wait_share", "slot_idle_share", "trained_turns_mean",
                         "stale_token_share")
               if k in runs[0]},
            "runs": runs}


def versus(side: dict[str, Any], trl: dict[str, Any]) -> dict[str, float]:
    """`side`'s ratios of the rates to TRL's, and its eval reward minus TRL's."""
    out = {f"ratio_{k}": round(side[k] / max(trl[k], 1e-9), 2)
           for k in ("trajectories_per_s", "trajectories_per_cpu_s", "tokens_per_s",
                     "turns_per_s")}
    return {**out, "quality_delta": round(side["final_eval"]["reward"]
                                          - trl["final_eval"]["reward"], 3)}



def same_work(earl: dict[str, Any], trl: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Model turns and model tokens per trajectory on both sides, and whether EARL's are
    within `SAME_WORK` of TRL's (the same work, not shorter episodes)."""
    def tokens(side: dict[str, Any]) -> float:
        return side["tokens_per_s"] / max(side["trajectories_per_s"], 1e-9)

    out = {}
    for key, of in (("turns_per_trajectory", lambda side: side["turns_mean"]),
                    ("model_tokens_per_trajectory", tokens)):
        e, t = of(earl), of(trl)
        out[key] = {"earl": round(e, 2), "trl_best": round(t, 2),
                    "within_5pct": abs(e / max(t, 1e-9) - 1) <= SAME_WORK}
    return out


def goals(out: dict[str, Any]) -> dict[str, bool]:
    """Issue 47's done-when against a result."""
    ev, earl = out["eval"], out["earl"]
    return {
        "ratio_trajectories_per_s>=2.5": out["ratio_trajectories_per_s"] >= 2.5,
        "ratio_trajectories_per_cpu_s>=1.5": out["ratio_trajectories_per_cpu_s"] >= 1.5,
        "eval.earl>=eval.trl_best": ev["earl"]["accuracy"] >= ev["trl_best"]["accuracy"],
        "turns_per_trajectory_within_5pct": out["turns_per_trajectory"]["within_5pct"],
        "straggler_wait_share<=0.10": earl.get("straggler_wait_share", 1.0) <= 0.10,
    }
