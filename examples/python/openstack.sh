#!/usr/bin/env bash
# Runs openstack_client.py (openstacksdk) against a running simulator: makes
# the virtual environment run.sh uses (cached in target/python-venv),
# installs openstacksdk into it, and runs the client.
# Usage: examples/python/openstack.sh --auth-url URL --server-name NAME [options]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-$ROOT/target/python-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# `python -m pip`, not the venv's pip script: a venv copied from another
# tree keeps that tree's path in its scripts' shebangs.
"$VENV/bin/python" -c 'import openstack' 2>/dev/null || \
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'openstacksdk>=4.0'
exec "$VENV/bin/python" "$ROOT/examples/python/openstack_client.py" "$@"
