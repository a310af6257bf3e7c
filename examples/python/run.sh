#!/usr/bin/env bash
# Runs attach.py against a live server: makes a virtual environment (cached
# in target/python-venv), installs grpcio, generates the stubs from the
# published proto, and runs the example.
# Usage: examples/python/run.sh HOST:PORT [attach.py options]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-$ROOT/target/python-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import grpc, grpc_tools, grpc_status' 2>/dev/null || \
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'grpcio>=1.60' 'grpcio-tools>=1.60' 'grpcio-status>=1.60'
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
"$VENV/bin/python" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$OUT" --grpc_python_out="$OUT" \
  "$ROOT/proto/volume_reconciler/v1/reconciler.proto"
SERVER=$1; shift
PYTHONPATH="$OUT" "$VENV/bin/python" "$ROOT/examples/python/attach.py" --server "$SERVER" "$@"
