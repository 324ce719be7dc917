#!/usr/bin/env bash
# Mutation testing with mutmut 3, then the score per file. Two targets:
#
# codecs (the default): fedcomp/codecs/, configuration [mutmut] in setup.cfg, run in place
#   scripts/mutation.sh                 # every codec file (configuration: [mutmut] in setup.cfg)
#   scripts/mutation.sh sbc golomb      # only these files' mutants (one file at a time is cheaper)
#   scripts/mutation.sh --retry sbc     # after sharper tests: re-run what survived or never ran
#   scripts/mutation.sh --report        # no run: print the scores of the last runs
#   MUTMUT_CHILDREN=2 scripts/mutation.sh   # worker processes (default 1: leave a core to others)
#
# Each mutant runs only the tests of the fast codec lane (tests/codecs, tests/test_feedback.py;
# not slow) that reach the mutated function. Results accumulate in mutants/ (a copy of the
# package; never commit it). With no file named, only mutants never judged run; naming a file
# re-runs all of its mutants; --retry re-runs only those not killed (after sharper tests):
#   python3 -m mutmut results                                      (every mutant not killed)
#   python3 -m mutmut show fedcomp.codecs.sbc.x__choose__mutmut_3  (the diff of one)
# Score = killed (incl. timeouts) / mutants with a verdict; "no tests" mutants count as survivors.
#
# flower: fedcomp/flower/ and the method files it drives ([mutmut] overridden by [mutmut:flower]
# in setup.cfg: the fast Flower lane as runner). It runs in a staged copy of the repository,
# build/mutation/flower/ (fedcomp/, tests/, pyproject.toml refreshed from the work tree on every
# run; its own mutants/ and results), so it never meets the codec run's mutants/:
#   scripts/mutation.sh flower                      # every file of the target
#   scripts/mutation.sh flower strategy mod         # fedcomp/flower/{strategy,mod}.py only
#   scripts/mutation.sh flower methods/base         # a path under fedcomp/ names any file
#   scripts/mutation.sh flower 'fedcomp.flower.mod.x_pick_device__mutmut_1'   # full names: as is
#   scripts/mutation.sh flower --report             # no run: the scores of the last runs
#   MUTMUT_SAMPLE=40 scripts/mutation.sh flower     # a seeded sample of 40 mutants per file
#       (MUTMUT_SEED picks another; either target): an estimate when a full run is too long.
#       The report counts every mutant with a verdict in mutants/: for a pure sample estimate,
#       start from a fresh build/mutation/flower/mutants (rm -rf it first).
# mutmut's own commands run in the staged copy:
#   cd build/mutation/flower && python3 -m mutmut show fedcomp.flower.mod.x_pick_device__mutmut_1
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export FEDCOMP_DATA_DIR="${FEDCOMP_DATA_DIR:-/work/shared/data}"
children="${MUTMUT_CHILDREN:-1}"
# one thread per mutant process: fair to a shared machine, and no torch thread pool across forks
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
# the ci examples without shrinking (tests/conftest.py): a failing example is enough to kill
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-mutation}"

target=codecs
if [[ "${1:-}" == "flower" ]]; then
    target=flower
    shift
    stage="$root/build/mutation/flower"
    mkdir -p "$stage"
    # a snapshot of the sources and tests (other work goes on in the tree meanwhile); copies keep
    # their times, and mutmut re-runs only the mutants of functions whose code changed
    rm -rf "$stage/fedcomp" "$stage/tests"
    cp -a "$root/fedcomp" "$root/tests" "$stage/"
    find "$stage/fedcomp" "$stage/tests" -name __pycache__ -prune -exec rm -rf {} +
    cp -p "$root/pyproject.toml" "$stage/"
    # [mutmut] with the keys of [mutmut:flower] in place of its own
    python3 - "$root/setup.cfg" "$stage/setup.cfg" <<'EOF'
import configparser
import sys

src = configparser.RawConfigParser()
src.read(sys.argv[1])
out = configparser.RawConfigParser()
out["mutmut"] = {**src["mutmut"], **src["mutmut:flower"]}
with open(sys.argv[2], "w") as f:
    out.write(f)
EOF
    cd "$stage"
fi

if [[ "${1:-}" == "--retry" ]]; then
    # after sharpening tests: re-run only the mutants (of the files named, else of all) that
    # survived, had no tests or were never judged; a named mutant always re-runs, kills stay
    shift
    mapfile -t names < <(python3 - "$target" "$@" <<'PY'
import json
import sys
from pathlib import Path

dirs = {"codecs": ["codecs"], "flower": ["flower", "methods"]}[sys.argv[1]]
wanted = {f.removesuffix(".py").split("/")[-1] for f in sys.argv[2:]}
for d in dirs:
    for meta in sorted(Path("mutants/fedcomp", d).glob("*.py.meta")):
        if wanted and meta.name[: -len(".py.meta")] not in wanted:
            continue
        for key, code in json.loads(meta.read_text()).get("exit_code_by_key", {}).items():
            if code in (None, 0, 5, 33):
                print(key)
PY
    )
    if ((${#names[@]})); then
        python3 -m mutmut run --max-children "$children" "${names[@]}" || true
    fi
    set -- --report
fi

if [[ "${1:-}" != "--report" ]]; then
    names=()
    for f in "$@"; do
        f=${f%.py}
        if [[ $f == fedcomp.* ]]; then
            names+=("$f")  # a mutant's (or a glob's) full name, e.g. from a report
        elif [[ $target == codecs ]]; then
            names+=("fedcomp.codecs.${f##*/}.*")
        elif [[ $f == */* ]]; then
            names+=("fedcomp.${f//\//.}.*")
        else
            names+=("fedcomp.flower.${f}.*")
        fi
    done
    if [[ -n "${MUTMUT_SAMPLE:-}" ]]; then
        # A seeded random sample of MUTMUT_SAMPLE mutants per file (all of a smaller file), for
        # a score estimate when running every mutant would take too long. Generate the mutants
        # and the test stats first (a filter that matches nothing runs no mutant), then pick.
        python3 -m mutmut run --max-children "$children" "fedcomp.__nothing__" >/dev/null 2>&1 || true
        mapfile -t names < <(python3 - "$target" "${MUTMUT_SEED:-0}" "$MUTMUT_SAMPLE" "${names[@]}" <<'PY'
import fnmatch
import json
import random
import sys
from pathlib import Path

target, seed, n, patterns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
dirs = {"codecs": ["codecs"], "flower": ["flower", "methods"]}[target]
rng = random.Random(seed)
for d in dirs:
    for meta in sorted(Path("mutants/fedcomp", d).glob("*.py.meta")):
        keys = sorted(json.loads(meta.read_text()).get("exit_code_by_key", {}))
        keys = [k for k in keys if not patterns or any(fnmatch.fnmatch(k, p) for p in patterns)]
        for k in sorted(rng.sample(keys, min(n, len(keys)))):
            print(k)
PY
        )
        [[ ${#names[@]} -gt 0 ]] || { echo "no mutants to sample" >&2; exit 1; }
        echo "sampled ${#names[@]} mutants (MUTMUT_SAMPLE=$MUTMUT_SAMPLE per file, MUTMUT_SEED=${MUTMUT_SEED:-0})"
    fi
    # mutmut exits non-zero when mutants survive; the report below is what matters
    python3 -m mutmut run --max-children "$children" "${names[@]}" || true
fi

python3 - "$target" <<'EOF'
import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

dirs = {"codecs": ["codecs"], "flower": ["flower", "methods"]}[sys.argv[1]]
rows = []
for d in dirs:
    for meta in sorted(Path("mutants/fedcomp", d).glob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if not codes:
            continue
        c = Counter(status_by_exit_code[v] for v in codes.values())
        killed = c["killed"] + c["timeout"] + c["caught by type check"]
        judged = len(codes) - c["not checked"] - c["skipped"]
        name = meta.name[: -len(".meta")]
        rows.append((name if len(dirs) == 1 else f"{d}/{name}", killed, judged, len(codes), c))
if not rows:
    raise SystemExit("no mutation results in mutants/: run scripts/mutation.sh first")
w = max(14, 2 + max(len(r[0]) for r in rows))
print(f"{'file':<{w}}{'killed':>8}{'judged':>8}{'score':>8}  survived  no-tests  timeout  not-checked")
tk = tj = 0
for name, killed, judged, total, c in rows:
    tk, tj = tk + killed, tj + judged
    score = f"{100 * killed / judged:.1f}%" if judged else "-"
    print(
        f"{name:<{w}}{killed:>8}{judged:>8}{score:>8}  {c['survived']:>8}  {c['no tests']:>8}"
        f"  {c['timeout']:>7}  {c['not checked']:>11}"
    )
print(f"{'total':<{w}}{tk:>8}{tj:>8}{(f'{100 * tk / tj:.1f}%' if tj else '-'):>8}")
EOF
