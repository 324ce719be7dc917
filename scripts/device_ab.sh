#!/usr/bin/env bash
# On a lent GPU machine: the whole-update codec rows of this tree against a baseline tree, in
# alternating processes (the machine's speed moves between processes: only ratios taken in the
# same process, and rows of the two trees taken turn about, compare), plus the CUDA tests and the
# engines' profile of this tree.
#
#   here:  mkdir -p .ab/base && git archive <commit> | tar -x -C .ab/base   (.ab/ is git-excluded)
#   there: the device tool with carry [".whl", ".ab"]:  OUT=$OUT bash scripts/device_ab.sh
#
# Everything goes to $OUT (default /tmp/device-ab): env.txt, pytest-cuda.log, codecs-{base,new}-N.json
# and .log, device-work.log/.json, and ab.txt, the table printed last.
set -u
OUT=${OUT:-/tmp/device-ab}
BASE=${BASE:-.ab/base}
ROUNDS=${ROUNDS:-2}
REPEAT=${REPEAT:-15}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # (DEVICE=cpu here: the plumbing only)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
HERE=$PWD
BASE_ABS=$(cd "$BASE" && pwd)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, report rc
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
}

{
    date -u
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY setup.py -q build_ext --inplace 2>&1 | tail -3
    (cd "$BASE_ABS" && $PY setup.py -q build_ext --inplace 2>&1 | tail -3)
} >"$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site:$HERE

step pytest-cuda 150 $PY -m pytest -p no:cacheprovider -n 0 -q -rs -m cuda tests/codecs tests/methods tests/flower/test_cuda_client.py
CASES=(--case sbc:p=0.01,mode=fast --case 3lc:s=1.0)
for i in $(seq "$ROUNDS"); do
    for tree in base new; do
        dir=$HERE
        [ "$tree" = base ] && dir=$BASE_ABS
        (cd "$dir" && export PYTHONPATH=/tmp/site:$dir && step "codecs-$tree-$i" 120 $PY -m fedcomp.bench codecs --device "$DEVICE" \
            --scope update --repeat "$REPEAT" "${CASES[@]}" --json "$OUT/codecs-$tree-$i.json")
    done
done
PROFILE=()
[ "$DEVICE" = cuda ] && PROFILE=(--profile)
step device-work 120 $PY -m fedcomp.bench device-work --device "$DEVICE" "${PROFILE[@]}" --copies 1 --json "$OUT/device-work.json"
tail -n 3 "$OUT/pytest-cuda.log"
$PY - "$OUT" "$ROUNDS" <<'EOF' | tee "$OUT/ab.txt"
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for i in range(1, rounds + 1):
    for tree in ("base", "new"):
        f = out / f"codecs-{tree}-{i}.json"
        if not f.exists():
            continue
        for r in json.loads(f.read_text()):
            key = (r["codec"], r["op"])
            rows.setdefault(key, {}).setdefault(tree, []).append(
                f"{r['median_s'] * 1e3:.2f} ms {r['copy_ratio']:.2f}x (copy {r['copy_median_s'] * 1e3:.2f}, best {r['copy_best_ratio']:.2f}x)"
            )
for (codec, op), by in rows.items():
    print(f"{codec:5} {op:10} base: {' | '.join(by.get('base', []))}")
    print(f"{'':5} {'':10} new:  {' | '.join(by.get('new', []))}")
EOF
grep -E "^(sbc|3lc) .*whole-update" "$OUT/device-work.log"
