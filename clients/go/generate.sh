#!/usr/bin/env bash
# Regenerates the Go stubs (volume_reconciler/v1/*.pb.go) from proto/ with
# the pinned generators, or, with --check, fails when the committed stubs
# differ from what they generate (CI runs that).
#
# The generators are Go programs pinned here by version and installed with
# `go install` into GOBIN_DIR (target/ci-tools/go-bin by default); buf
# (BUF, target/ci-tools/buf/... as .ci/run installs it) drives them as local
# plugins, so nothing is fetched from a remote plugin registry.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2
GOBIN_DIR=${GOBIN_DIR:-$root/target/ci-tools/go-bin}
BUF=${BUF:-$root/target/ci-tools/buf/node_modules/.bin/buf}

check=false
case "${1:-}" in
  --check) check=true ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

if [ ! -x "$BUF" ]; then
  echo "error: buf not found at $BUF: run .ci/run once (it installs buf 1.75.0 there) or set BUF" >&2
  exit 1
fi
mkdir -p "$GOBIN_DIR"
# At the pinned versions, whatever a go.mod around says (go install
# pkg@version ignores it); quick when they are already there.
for tool in "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION" \
  "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION"; do
  (cd "$GOBIN_DIR" && GOBIN="$GOBIN_DIR" go install "$tool")
done

out=$here
if $check; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
(cd "$here" && PATH="$GOBIN_DIR:$PATH" "$BUF" generate --template buf.gen.yaml -o "$out")

if $check; then
  if ! diff -ru "$here/volume_reconciler" "$out/volume_reconciler"; then
    echo "error: clients/go/volume_reconciler is stale: run clients/go/generate.sh and commit the result" >&2
    exit 1
  fi
  echo "generated Go stubs are up to date"
fi
