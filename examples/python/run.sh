#!/usr/bin/env bash
# Runs attach.py against a live server: makes a virtual environment (cached
# in target/python-venv), installs grpcio, generates the stubs from the
# published proto, and runs the example.
# Usage: examples/python/run.sh HOST:PORT [attach.py options]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-$ROOT/target/python-venv}
# Several runs may start at once (the tests run in parallel on a fresh
# clone): one builds the environment under a lock while the others wait, and
# a half-built environment is never used.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if ! "$VENV/bin/python" -c 'import grpc, grpc_tools, grpc_status' 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'grpcio>=1.60' 'grpcio-tools>=1.60' 'grpcio-status>=1.60'
fi
flock -u 9
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
"$VENV/bin/python" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$OUT" --grpc_python_out="$OUT" \
  "$ROOT/proto/volume_reconciler/v1/reconciler.proto"
SERVER=$1; shift
PYTHONPATH="$OUT" "$VENV/bin/python" "$ROOT/examples/python/attach.py" --server "$SERVER" "$@"
