#!/usr/bin/env bash
# The one prepared GPU check (issue 52). Whoever gets a GPU machine runs this script, from the
# repository root, and files what it writes under docs/gpu-runs/<date>/:
#
#     bash tests/gpu/run.sh                 # results in $OUT when set (the lent machine's tool),
#                                           # else in tests/gpu/out/ (ignored by git)
#     bash tests/gpu/run.sh --fetch-wheels  # on a machine with a registry: the wheels a bare
#                                           # GPU machine lacks, into .gpu-wheels/ (carry it)
#
# Time budget: under 8 minutes in all on one GPU, each stage capped by `timeout`:
#   1. environment report (nvidia-smi, Python, torch, what is importable)      ~10 s
#   2. pytest -m gpu tests/gpu, JUnit file                                     cap 330 s
#      (~1-2 min without vLLM's CUDA build, whose tests then skip; with it, the colocated
#      `earl train` alone may need 5+ min: raise GPU_TESTS_S, the run then exceeds 8 min)
#   3. bench/weights_gpu.py --json (512 MiB, 5 pushes: CUDA IPC vs the host path) cap 90 s
#   4. the dry-run plan for 8 GPUs (earl train --dry-run --gpus 8 --json)     cap 45 s
# Covered: the colocated trainer phases (offload to host memory and back on the GPU, weights by
# CUDA IPC: test_trainer_offload_gpu, test_weights_ipc_gpu, test_weights_lanes_gpu), the megatron
# trainer at TP 1 (test_trainer_gpu), the 8-GPU plan (test_plan_gpu and stage 4), and vLLM on
# CUDA where its CUDA build is installed (test_stages_on_gpu, test_colocated_gpu).
#
# Writes: gpu-tests.xml (JUnit), gpu-tests.log, weights_gpu.json, plan-8gpu.json, env.txt, and
# summary.json (the GPU, each stage's exit code and seconds, each covered item: passed, failed,
# skipped with its reason, or not collected). Exit code 0: on a GPU, every stage ran, nothing
# failed and the plan is as expected (without a GPU everything skips: exit 1).
#
# On a machine where `earl` is not installed (a bare lent machine: no registry, only the carried
# tree), the checkout is laid out as the installed package in a temporary folder on PYTHONPATH,
# and wheels in $EARL_GPU_WHEELS (default .gpu-wheels/) are unpacked there first.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
WHEELS=${EARL_GPU_WHEELS:-$ROOT/.gpu-wheels}
if [ "${1:-}" = "--fetch-wheels" ]; then
  # what the lent H100/H200 machines lacked (docs/gpu.md): Python 3.12, manylinux x86-64
  mkdir -p "$WHEELS"
  exec "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    pyzmq cryptography cffi pycparser pytest pluggy iniconfig pygments pytest-asyncio \
    pytest-timeout 'megatron-core==0.16.1'
fi
[ $# -eq 0 ] || { echo "usage: tests/gpu/run.sh [--fetch-wheels]" >&2; exit 2; }
RES=${OUT:-$ROOT/tests/gpu/out}
mkdir -p "$RES"
PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
WORK=$(mktemp -d /tmp/earl-gpu-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
log() { echo "[run.sh $(date +%H:%M:%S)] $*" | tee -a "$RES/run.log" >&2; }
declare -A RC SECS
stage() {  # stage NAME LIMIT_S CMD...: run CMD from $WORK (no checkout folder shadows `earl`)
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  log "$name (cap ${limit} s)"
  (cd "$WORK" && timeout --kill-after=10 "$limit" "$@")
  RC[$name]=$?
  SECS[$name]=$((SECONDS - t0))
  log "$name: exit ${RC[$name]} in ${SECS[$name]} s"
}

# -- the package: installed, or laid out from the checkout ------------------------------------
if ! (cd "$WORK" && "$PY" -c "import earl.runtime" 2>/dev/null); then
  mkdir -p "$WORK/site/earl"
  for f in "$ROOT"/earl/*; do ln -s "$f" "$WORK/site/earl/"; done
  for sub in runtime agents envs; do ln -s "$ROOT/$sub" "$WORK/site/earl/$sub"; done
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$WHEELS"/*.whl \
      2>&1 | tee -a "$RES/run.log"
  fi
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  log "earl is not installed: laid out from the checkout in $WORK/site"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# -- 1. environment -----------------------------------------------------------------------------
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo "(no git)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  (cd "$WORK" && "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available(), "gpus", torch.cuda.device_count())
for name in ("vllm", "megatron.core", "zmq", "cryptography", "pytest_asyncio", "pytest_timeout",
             "earl.runtime"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "importable"))
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        print(name, "MISSING:", type(exc).__name__, str(exc)[:120])
EOF
  )
} >"$RES/env.txt" 2>&1
cat "$RES/env.txt" >&2

# -- 2. the GPU-marked tests -----------------------------------------------------------------------
stage tests "${GPU_TESTS_S:-330}" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs \
  --rootdir "$ROOT" -c "$ROOT/pyproject.toml" --junitxml "$RES/gpu-tests.xml" \
  --durations=15 "$ROOT/tests/gpu" >"$RES/gpu-tests.log" 2>&1
tail -n 25 "$RES/gpu-tests.log" >&2

# -- 3. weights trainer -> rollout on one GPU ------------------------------------------------------
stage bench 90 "$PY" "$ROOT/bench/weights_gpu.py" --json >"$RES/weights_gpu.json" \
  2>>"$RES/run.log"

# -- 4. the plan for an 8-GPU node (this GPU's memory; 80 GiB where there is no GPU) -------------
MEM=()
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
  || MEM=(--gpu-memory-gib 80)
stage plan 45 "$PY" -m earl.cli train --placement.device=cuda --placement.rollout=2 \
  --placement.rollout_tp=2 --placement.trainer=4 --placement.trainer_tp=2 \
  --algorithm.kl_coef=0 --dry-run --gpus 8 "${MEM[@]}" --json --output-dir "$WORK/plan-run" \
  >"$RES/plan-8gpu.json" 2>>"$RES/run.log"

# -- summary ---------------------------------------------------------------------------------------
for s in tests bench plan; do echo "$s ${RC[$s]} ${SECS[$s]}"; done >"$WORK/stages.txt"
"$PY" - "$RES" "$WORK/stages.txt" <<'EOF' | tee -a "$RES/run.log" >&2
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

res, stages = Path(sys.argv[1]), Path(sys.argv[2]).read_text().split("\n")
out = {"stages": {n: {"exit": int(rc), "seconds": int(s)}
                  for n, rc, s in (line.split() for line in stages if line)}}
cases = {}
if (res / "gpu-tests.xml").is_file():
    for c in ET.parse(res / "gpu-tests.xml").iter("testcase"):
        name = f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}"
        kids = {k.tag: k for k in c}
        state = next((t for t in ("failure", "error", "skipped") if t in kids), "passed")
        why = kids[state].get("message", "") if state != "passed" else ""
        cases[name] = f"{state}: {why}"[:200] if why else state
out["tests"] = cases
covered = {  # the issue's list -> the tests that cover it
    "trainer offload and back on the GPU (colocated phases)": "test_trainer_offload_gpu::",
    "weights by CUDA IPC": "test_weights_ipc_gpu::",
    "a replica on the trainer's GPU gets CUDA IPC buckets":
        "test_weights_lanes_gpu::test_a_replica_on_the_publishers",
    "megatron trainer at TP 1": "test_trainer_gpu::test_megatron",
    "dry-run plan for 8 GPUs (test)": "test_plan_gpu::",
    "vLLM on CUDA": "test_stages_on_gpu::test_vllm",
    "vLLM sleep/wake, colocated earl train": "test_colocated_gpu::",
}
out["covered"] = {k: sorted({v for n, v in cases.items() if n.startswith(p)}) or ["not collected"]
                  for k, p in covered.items()}
try:
    plan = json.loads((res / "plan-8gpu.json").read_text().strip().splitlines()[-1])["plan"]
    args = plan["rollout"]["engine_args"][0]
    ok = (plan["rollout"]["devices"] == [[0, 1], [2, 3]]
          and plan["trainer"]["devices"] == [[4], [5], [6], [7]]
          and args["enforce_eager"] is False and args["enable_chunked_prefill"] is True
          and args["dtype"] == "bfloat16")
    out["plan_8gpu"] = "as expected" if ok else "UNEXPECTED (see plan-8gpu.json)"
except Exception as exc:  # noqa: BLE001 - reported, and fails the run below
    ok, out["plan_8gpu"] = False, f"unreadable: {type(exc).__name__}: {exc}"
try:
    bench = json.loads((res / "weights_gpu.json").read_text())
    out["bench"] = bench.get("skipped") or {k: v for k, v in bench.items()
                                            if not isinstance(v, (list, dict))}
except Exception as exc:  # noqa: BLE001
    out["bench"] = f"unreadable: {type(exc).__name__}: {exc}"
import torch

out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
failed = [n for n, v in cases.items() if v.startswith(("failure", "error"))]
out["ok"] = bool(ok and out["gpu"] and not failed
                 and all(s["exit"] == 0 for s in out["stages"].values()))
(res / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: out[k] for k in ("gpu", "stages", "covered", "plan_8gpu", "ok")},
                 indent=1))
sys.exit(0 if out["ok"] else 1)
EOF
