# Sourced by scripts/device_check.sh and scripts/device_ab.sh (the GPU machine's checks):
# step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output to ${LOGDIR:-$OUT}/NAME.log,
# and a line saying its exit status and time to the terminal and $OUT/env.txt (a failed step does
# not stop the script: the others' figures still come back).
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"${LOGDIR:-$OUT}/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
}
