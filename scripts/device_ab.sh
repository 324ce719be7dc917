#!/usr/bin/env bash
# On a lent GPU machine: the whole-update codec rows of this tree against baseline trees, in
# alternating processes (the machine's speed moves between processes: only ratios taken in the
# same process, and rows of the trees taken turn about, compare), plus the CUDA tests and the
# engines' profile of this tree.
#
#   here:  mkdir -p .ab/base && git archive <commit> | tar -x -C .ab/base   (.ab/ is git-excluded;
#          several baselines: one folder each under .ab/, named in BASES)
#   there: the device tool with carry [".whl", ".ab"]:  OUT=$OUT bash scripts/device_ab.sh
#
# $OUT (default /tmp/device-ab) gets three files (the tool brings back at most eight): ab.txt, the
# table printed last; env.txt; logs.tgz, every step's log and JSON (pytest-cuda, codecs-TREE-N,
# device-work).
set -u
OUT=${OUT:-/tmp/device-ab}
BASES=${BASES:-.ab/base}
TESTED=${TESTED:-}  # baselines whose CUDA tests run too (this tree's always do)
FULL=${FULL:-0}     # 1: also this tree's whole codecs table (every codec, both scopes)
ROUNDS=${ROUNDS:-2}
REPEAT=${REPEAT:-15}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # (DEVICE=cpu here: the plumbing only)
LOGS=$OUT/logs
LOGDIR=$LOGS
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
HERE=$PWD
TREES=()
for b in $BASES; do TREES+=("$(cd "$b" && pwd)"); done
TREES+=("$HERE")

. "$(dirname "$0")/device_step.sh"
label() { [ "$1" = "$HERE" ] && echo new || basename "$1"; }

{
    date -u
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    for t in "${TREES[@]}"; do (cd "$t" && $PY setup.py -q build_ext --inplace 2>&1 | tail -3); done
} >"$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site:$HERE

CUDA_TESTS=(tests/codecs tests/methods tests/native tests/flower/test_cuda_client.py)
step pytest-cuda 150 $PY -m pytest -p no:cacheprovider -n 0 -q -rs -m cuda "${CUDA_TESTS[@]}"
CASES=(--case sbc:p=0.01,mode=fast --case 3lc:s=1.0)
for i in $(seq "$ROUNDS"); do
    for t in "${TREES[@]}"; do
        name=$(label "$t")
        (cd "$t" && export PYTHONPATH=/tmp/site:$t && step "codecs-$name-$i" 120 $PY -m fedcomp.bench codecs --device "$DEVICE" \
            --scope update --repeat "$REPEAT" "${CASES[@]}" --json "$LOGS/codecs-$name-$i.json")
    done
done
PROFILE=()
[ "$DEVICE" = cuda ] && PROFILE=(--profile)
step device-work 120 $PY -m fedcomp.bench device-work --device "$DEVICE" "${PROFILE[@]}" --copies 1 --json "$LOGS/device-work.json"
# (after the A/B: what matters most first, should the call run out of time)
for b in $TESTED; do
    t=$(cd "$b" && pwd)
    (cd "$t" && export PYTHONPATH=/tmp/site:$t && step "pytest-cuda-$(label "$t")" 150 $PY -m pytest -p no:cacheprovider -n 0 -q -rs -m cuda "${CUDA_TESTS[@]}")
done
[ "$FULL" = 1 ] && step codecs-full 150 $PY -m fedcomp.bench codecs --device "$DEVICE" --repeat 7 --json "$LOGS/codecs-full.json"
for f in "$LOGS"/pytest-cuda*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
$PY - "$LOGS" "$ROUNDS" $(for t in "${TREES[@]}"; do label "$t"; done) <<'PYEOF' | tee "$OUT/ab.txt"
import json, sys
from pathlib import Path
logs, rounds, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rows = {}
for i in range(1, rounds + 1):
    for name in names:
        f = logs / f"codecs-{name}-{i}.json"
        if not f.exists():
            continue
        for r in json.loads(f.read_text()):
            rows.setdefault((r["codec"], r["op"]), {}).setdefault(name, []).append(
                f"{r['median_s'] * 1e3:.2f} ms {r['copy_ratio']:.2f}x (copy {r['copy_median_s'] * 1e3:.2f}, best {r['copy_best_ratio']:.2f}x)"
            )
for (codec, op), by in rows.items():
    for j, name in enumerate(names):
        print(f"{codec if j == 0 else '':5} {op if j == 0 else '':10} {name:5} {' | '.join(by.get(name, []))}")
PYEOF
grep -E "^(sbc|3lc) .*whole-update" "$LOGS/device-work.log"
[ "$FULL" = 1 ] && grep -E " (update|per-tensor) " "$LOGS/codecs-full.log" | cut -c1-150
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
