#!/usr/bin/env bash
# The CUDA checks and GPU benchmarks of issue #13, as one short script for a lent GPU machine.
#
#   bash scripts/device_check.sh            # on the GPU machine, from the repository root
#   DEVICE=cpu bash scripts/device_check.sh # here: the same steps on the CPU (the plumbing only)
#
# Everything goes to $OUT (default /tmp/device-check): env.txt, pytest-cuda.log,
# codecs.log/.json, device-work.log/.json, device-work-shrunk.log/.json, encode-phases.log, fast-lane.log. Each step
# has its own time limit and the script goes on after a failure, so one broken step still leaves
# the others' figures.
#
# The GPU image has torch but not flwr, pydantic and a few of their needs: when .whl/ holds
# wheels (see scripts/device_wheels.sh) they are installed into /tmp/site first. It has no Ray,
# so Flower simulations (`python -m fedcomp run`) do not run there; the real mod and strategy do,
# in process (tests/flower/test_cuda_client.py).
set -u
OUT=${OUT:-/tmp/device-check}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
PY=${PYTHON:-python3}

. "$(dirname "$0")/device_step.sh"

{
    date -u
    WHEELS=${WHEELS:-.whl}
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
            && export PYTHONPATH=/tmp/site:$PWD
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch, numpy, google.protobuf as pb; print('torch', torch.__version__, 'numpy', numpy.__version__, 'protobuf', pb.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
    $PY setup.py -q build_ext --inplace 2>&1 | tail -3
    $PY -c "import fedcomp._native as n, flwr, pydantic; print('kernels', n.status(), 'flwr', flwr.__version__, 'pydantic', pydantic.VERSION)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
export PYTHONPATH=${PYTHONPATH:-$PWD}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD

CUDA_TESTS=(tests/codecs/test_flat.py tests/codecs/test_sbc.py tests/codecs/test_stc.py tests/codecs/test_sbc_device.py
    tests/codecs/test_threelc_device.py tests/codecs/test_graphs.py tests/codecs/test_segments.py tests/methods/test_flat_update.py tests/methods/test_dense_device.py tests/flower/test_cuda_client.py
    tests/test_bench_cli.py)
step pytest-cuda 150 $PY -m pytest -p no:cacheprovider -n 0 -q -rs -m cuda "${CUDA_TESTS[@]}"
PROFILE=()
[ "$DEVICE" = cuda ] && PROFILE=(--profile)
step codecs 150 $PY -m fedcomp.bench codecs --device "$DEVICE" --repeat "${REPEAT:-7}" --json "$OUT/codecs.json"
step device-work 120 $PY -m fedcomp.bench device-work --device "$DEVICE" "${PROFILE[@]}" --copies 1,4 --json "$OUT/device-work.json"
# The same 161 tensors with a thousandth of their values: what a call costs whatever its values
# (launches, syncs, the host's per-tensor Python), beside the row above that moves them all.
step device-work-shrunk 60 $PY -m fedcomp.bench device-work --device "$DEVICE" --copies 1 --repeat 15 --shrink 1000 --json "$OUT/device-work-shrunk.json"
# Where an encode's time goes, phase by phase (graphs on and off, 3LC's zero runs on the device and the host).
SHRINK=()
[ "$DEVICE" = cpu ] && SHRINK=(--shrink 1000 --repeat 3)
step encode-phases 90 $PY scripts/encode_phases.py --device "$DEVICE" "${SHRINK[@]}"
# The fast lane with a GPU present (client-device 'auto' picks it): what changes when CUDA is there.
# (only while the whole script stays inside ${BUDGET_S:-420} s: the device time is short)
left=$((${BUDGET_S:-420} - SECONDS))
[ "$left" -gt 60 ] && step fast-lane "$left" $PY -m pytest -p no:cacheprovider -n "${WORKERS:-8}" -v --maxfail 30 -m "not slow and not cuda"
tail -n 4 "$OUT/pytest-cuda.log"
grep -E "FAILED|ERROR" "$OUT/fast-lane.log" | head -20 # (-v: each failure named as it comes, even where the time limit cuts the run)
tail -n 1 "$OUT/fast-lane.log"
