#!/usr/bin/env bash
# Regenerate the committed protobuf Python code from proto/.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: the repository root, i.e. fedcomp/v1/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
python -m grpc_tools.protoc -I "$root/proto" --python_out="$out" --pyi_out="$out" \
  "$root"/proto/fedcomp/v1/*.proto
