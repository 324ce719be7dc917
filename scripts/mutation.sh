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
# Each mutant runs only the tests of the fast codec lane (tests/codecs, tests/test_feedback.py,
# tests/test_deft.py, tests/test_gradiveq.py; not slow) that reach the mutated function. Results
# accumulate in mutants/ (a copy of the package; never commit it); the files that are not mutated
# are refreshed there from the work tree on every run. With no file named, only mutants never
# judged run; naming a file re-runs all of its mutants; --retry re-runs only those not killed:
#   python3 -m mutmut results                                      (every mutant not killed)
#   python3 -m mutmut show fedcomp.codecs.sbc.x__choose__mutmut_3  (the diff of one)
# Score = killed (incl. timeouts) / mutants with a verdict; "no tests" mutants count as survivors.
#
# Sampling (either target): a full run is ~3,900 codec mutants, hours on a shared 2-core machine.
#   MUTMUT_SAMPLE=70 MUTMUT_SEED=17 scripts/mutation.sh base dense    # 70 mutants per file, seeded
#   MUTMUT_SAMPLE=70 MUTMUT_SEED=17 scripts/mutation.sh --retry base dense   # the sample's survivors
#   MUTMUT_SAMPLE=70 MUTMUT_SEED=17 scripts/mutation.sh --report base dense  # scores of the sample
# With MUTMUT_SAMPLE set, run, --retry and --report all work on the same seeded sample: for each
# named file (all files when none is named) random.Random(MUTMUT_SEED) picks MUTMUT_SAMPLE of its
# mutants (all of a smaller file). A file's sample depends only on the seed, the size and its own
# mutants (a change to the file's source changes it), and --report scores exactly those mutants
# (other verdicts in mutants/ are left out).
# Without MUTMUT_SAMPLE, --report counts every mutant with a verdict in mutants/.
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
# mutmut's own commands run in the staged copy:
#   cd build/mutation/flower && python3 -m mutmut show fedcomp.flower.mod.x_pick_device__mutmut_1
# docs/mutation.md has the measured scores and the equivalent mutants.
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
    python3 - "$root/setup.cfg" "$stage/setup.cfg" <<'PY'
import configparser
import sys

src = configparser.RawConfigParser()
src.read(sys.argv[1])
out = configparser.RawConfigParser()
out["mutmut"] = {**src["mutmut"], **src["mutmut:flower"]}
with open(sys.argv[2], "w") as f:
    out.write(f)
PY
    cd "$stage"
fi

mode=run
case "${1:-}" in
--retry) mode=retry; shift ;;
--report) mode=report; shift ;;
esac

# file names (or full mutant names) -> mutant-name patterns
patterns=()
for f in "$@"; do
    f=${f%.py}
    if [[ $f == fedcomp.* ]]; then
        patterns+=("$f")  # a mutant's (or a glob's) full name, e.g. from a report
    elif [[ $target == codecs && ${f##*/} == __init__ ]]; then
        patterns+=("fedcomp.codecs.x*")  # mutmut drops "__init__." from the names of its mutants
    elif [[ $target == codecs ]]; then
        patterns+=("fedcomp.codecs.${f##*/}.*")
    elif [[ $f == */* ]]; then
        patterns+=("fedcomp.${f//\//.}.*")
    else
        patterns+=("fedcomp.flower.${f}.*")
    fi
done

# Lists mutant names from mutants/: argv = target, which ("all" | "open": not killed), sample size
# ("" = no sampling), seed, patterns. The sample is drawn from every mutant of the matching files,
# whatever their verdicts, so it depends only on the mutants, the seed and the names given.
read -r -d '' PICK <<'PY' || true
import fnmatch
import json
import random
import sys
from pathlib import Path

target, which, n, seed, patterns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
dirs = {"codecs": ["codecs"], "flower": ["flower", "methods"]}[target]
for d in dirs:
    for meta in sorted(Path("mutants/fedcomp", d).glob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        keys = sorted(k for k in codes if not patterns or any(fnmatch.fnmatch(k, p) for p in patterns))
        if n:  # a fresh generator per file: a file's sample does not depend on the others named
            keys = sorted(random.Random(seed).sample(keys, min(int(n), len(keys))))
        for k in keys:
            # not killed: survived (0), no tests (33), never judged (None); 5: pytest found no test
            if which == "all" or codes[k] in (None, 0, 5, 33):
                print(k)
PY
pick() { python3 -c "$PICK" "$target" "$1" "${MUTMUT_SAMPLE:-}" "${MUTMUT_SEED:-0}" "${patterns[@]}"; }

if [[ $target == codecs && $mode != report ]]; then
    # mutmut copies the package into mutants/ once and then mutates only fedcomp/codecs/: refresh
    # every other file there from the work tree (the codec tests import fedcomp.wire, methods...)
    python3 - <<'PY'
import filecmp
import shutil
from pathlib import Path

src, dst = Path("fedcomp"), Path("mutants/fedcomp")
if dst.is_dir():
    for f in src.rglob("*"):
        rel = f.relative_to(src)
        if f.is_dir() or "__pycache__" in rel.parts or rel.parts[0] == "codecs":
            continue
        out = dst / rel
        if not out.exists() or not filecmp.cmp(f, out, shallow=False):
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out)
    for f in list(dst.rglob("*.py")):
        rel = f.relative_to(dst)
        if rel.parts[0] != "codecs" and "__pycache__" not in rel.parts and not (src / rel).exists():
            f.unlink()
PY
fi

if [[ $mode != report ]]; then
    if [[ -n "${MUTMUT_SAMPLE:-}" || $mode == retry ]]; then
        if [[ $mode == run ]]; then
            # generate the mutants and the test stats first (a filter that matches nothing runs
            # no mutant), then pick by name
            python3 -m mutmut run --max-children "$children" "fedcomp.__nothing__" >/dev/null 2>&1 || true
        fi
        if [[ $mode == retry ]]; then
            mapfile -t names < <(pick open)  # the survivors, no-tests and never judged
        else
            mapfile -t names < <(pick all)
            [[ ${#names[@]} -gt 0 ]] || { echo "no mutants to sample" >&2; exit 1; }
            echo "sampled ${#names[@]} mutants (MUTMUT_SAMPLE=$MUTMUT_SAMPLE per file, MUTMUT_SEED=${MUTMUT_SEED:-0})"
        fi
        # mutmut exits non-zero when mutants survive; the report below is what matters
        if ((${#names[@]})); then
            python3 -m mutmut run --max-children "$children" "${names[@]}" || true
        fi
    else
        python3 -m mutmut run --max-children "$children" "${patterns[@]}" || true
    fi
fi

# the report: every mutant with a verdict, or with MUTMUT_SAMPLE set only the sample's
scope=$(mktemp)
trap 'rm -f "$scope"' EXIT
if [[ -n "${MUTMUT_SAMPLE:-}" ]]; then pick all >"$scope"; fi
python3 - "$target" "${MUTMUT_SAMPLE:-}" "$scope" <<'PY'
import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

dirs = {"codecs": ["codecs"], "flower": ["flower", "methods"]}[sys.argv[1]]
sampled = bool(sys.argv[2])
scope = set(Path(sys.argv[3]).read_text().split())
rows = []
for d in dirs:
    for meta in sorted(Path("mutants/fedcomp", d).glob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if sampled:
            codes = {k: v for k, v in codes.items() if k in scope}
        if not codes:
            continue
        c = Counter(status_by_exit_code[v] for v in codes.values())
        killed = c["killed"] + c["timeout"] + c["caught by type check"]
        judged = len(codes) - c["not checked"] - c["skipped"]
        name = meta.name[: -len(".meta")]
        rows.append((name if len(dirs) == 1 else f"{d}/{name}", killed, judged, len(codes), c))
if not rows:
    raise SystemExit("no mutation results in mutants/: run scripts/mutation.sh first")
if sampled:
    print(f"scores of the sample only ({sum(r[3] for r in rows)} mutants)")
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
PY
