"""The most a selector could gain over the static runs of a `bench/selector.py` sweep.

    python bench/selector_bound.py --json [--from FILE ...] [--save]

A selector beats the best static run only where the fastest layout changes as contexts grow.
This reads saved sweeps (`--from`: `bench/results/selector-*.json` files, default every full
one there) and, for each, prices the selector run's work (its trained tokens per context
bucket, `by_context`) at the *oracle*: in each bucket, the fastest rate any static run that
finished without cutting measured there: a policy that knew every swept layout's rate in advance
and switched between them at no cost at every step. A static run takes, in a bucket it never
reached, its rate in the longest one below (`_selector_runs.rate_at`, as the sweep's
`matched_seconds` prices it): that
favours it, so the oracle is an upper bound for a policy choosing among the swept layouts.

Prints one JSON object: `sweeps`, one entry per file with `commit`, `fastest_by_bucket`
(bucket -> the fastest clean static run there, its tokens/s, the work's tokens),
`best_static` (the clean static run fastest on that work) and
`oracle_ratio_vs_best_static` (its seconds over the oracle's: the highest
`matched_ratio_vs_best_static` any such policy reaches), `oracle_ratio_vs_best_static_same_devices`,
`oracle_ratio_vs_step0_pick` (the pick cuts contexts: priced at its own rates, favoured above
its longest bucket), `selector_share_of_oracle` (the oracle's seconds over the selector run's
measured ones) and `oracle_ratio_max_over_works` (the largest oracle ratio with every clean
static run's own work in place of the selector's); then `summary`: the spread of each figure
over the sweeps, and whether the issue's goals (1.1x and 1.5x) are within the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _results
from _selector_runs import cut_below_model, rate_at

Runs = dict[str, dict[str, object]]
Work = dict[str, list[float]]  # bucket -> [tokens, seconds]


def seconds(work: Work, rate: dict[int, float]) -> float:
    """The seconds `work` takes at `rate` (bucket -> tokens/s)."""
    return sum(t / rate[int(b)] for b, (t, _) in work.items() if t > 0)


def bound(work: Work, runs: Runs) -> tuple[dict[str, float], float, dict[int, str]]:
    """Each run's seconds for `work`, the oracle's seconds, and the fastest run per bucket."""
    buckets = [int(b) for b, (t, _) in work.items() if t > 0]
    rates = {k: {b: rate_at(r, b) for b in buckets} for k, r in runs.items()}
    each = {k: seconds(work, rt) for k, rt in rates.items()}
    fastest = {b: max(rates, key=lambda k, b=b: rates[k][b]) for b in buckets}
    oracle = seconds(work, {b: rates[fastest[b]][b] for b in buckets})
    return each, oracle, fastest


def clean(runs: Runs) -> Runs:
    """The static runs that finished without cutting a context below the model's positions."""
    from earl.recipes.gauntlet import MAX_MODEL_LEN

    return {k: v for k, v in runs.items() if v["outcome"] == "finished"
            and not cut_below_model(v, MAX_MODEL_LEN) and v.get("by_context")}


def one_sweep(result: dict[str, object]) -> dict[str, object]:
    """The bound for one saved `bench/selector.py` result."""
    statics: Runs = result["static_runs"]  # type: ignore[assignment]
    sel: dict[str, object] = result["selector_run"]  # type: ignore[assignment]
    work: Work = sel["by_context"]  # type: ignore[assignment]
    ok = clean(statics)
    each, oracle, fastest = bound(work, ok)
    best = min(each, key=each.__getitem__)
    devices = sel["devices"]
    same = {k: v for k, v in ok.items() if v["devices"] == devices}
    each_same, oracle_same, _ = bound(work, same)
    pick = str(result["step0_pick"])
    pick_seconds = seconds(work, {int(b): rate_at(statics[pick], int(b)) for b in work})
    over_works = max(min(e.values()) / o for e, o, _ in
                     (bound(r["by_context"], ok) for r in ok.values()))  # type: ignore[arg-type]
    return {
        "selector_tokens_per_s": sel["tokens_per_s"],
        "fastest_by_bucket": {str(b): {"run": k, "tokens_per_s": round(rate_at(ok[k], b)),
                                       "tokens": round(work[str(b)][0])}
                              for b, k in sorted(fastest.items())},
        "best_static": best,
        "oracle_ratio_vs_best_static": round(each[best] / oracle, 3),
        "best_static_same_devices": min(each_same, key=each_same.__getitem__),
        "oracle_ratio_vs_best_static_same_devices": round(min(each_same.values()) / oracle_same,
                                                          3),
        "step0_pick": pick,
        "oracle_ratio_vs_step0_pick": round(pick_seconds / oracle, 3),
        "selector_share_of_oracle": round(oracle / float(str(sel["loop_s"])), 3),
        "oracle_ratio_max_over_works": round(over_works, 3),
    }


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--from", dest="files", nargs="*", default=None,
                    help="saved bench/selector.py results (default: every full one in "
                         "bench/results/)")
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    files = [Path(f) for f in args.files] if args.files else \
        sorted(_results.RESULTS.glob("selector-*.json"))
    sweeps: dict[str, dict[str, object]] = {}
    for path in files:
        rec = json.loads(path.read_text())
        res = rec.get("result", rec)
        if res.get("quick") or res.get("summarized_from") or \
                not clean(res.get("static_runs", {})) or \
                not res.get("selector_run", {}).get("by_context"):
            continue  # a --quick run, a --runs summary (part of a sweep), or one saved
            # before runs kept rates per context
        commit = str(rec.get("facts", {}).get("git", {}).get("commit", ""))[:7]
        statics = sorted({str(r.get("commit", ""))[:7] for r in res["static_runs"].values()})
        sweeps[path.name] = {"commit": commit, "static_commits": statics, **one_sweep(res)}
    if not sweeps:
        raise SystemExit("selector_bound: no full bench/selector.py result with rates per "
                         "context found; pass --from bench/results/selector-DATE.json")
    keys = ("oracle_ratio_vs_best_static", "oracle_ratio_vs_best_static_same_devices",
            "oracle_ratio_vs_step0_pick", "selector_share_of_oracle",
            "oracle_ratio_max_over_works")
    summary: dict[str, object] = {k: spread([float(str(s[k])) for s in sweeps.values()])
                                  for k in keys}
    summary["goal_1.1x_best_static_within_bound"] = any(
        float(str(s["oracle_ratio_max_over_works"])) >= 1.1 for s in sweeps.values())
    summary["goal_1.5x_step0_pick_within_bound"] = any(
        float(str(s["oracle_ratio_vs_step0_pick"])) >= 1.5 for s in sweeps.values())
    out = {"sweeps": sweeps, "summary": summary}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    if args.save:
        _results.save("selector_bound", out, quick=False, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
