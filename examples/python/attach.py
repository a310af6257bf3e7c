#!/usr/bin/env python3
"""Attach and detach a volume through volume-reconciler from Python.

Uses the standard grpcio package and stubs generated from the published
proto (examples/python/run.sh does both). Shows the three things an
orchestrator needs: an idempotency key per intent (retrying with the same
key is always safe), a deadline on every call, and reading the
google.rpc.ErrorInfo of a failure (its reason and metadata, e.g. the
operation_id to look up later).

Client options, the same as the `volume-reconciler ops` command's:
--server HOST:PORT (http:// or https:// accepted), --token / --token-file /
VOLUME_RECONCILER_TOKEN (sent as `authorization: Bearer`), and --ca,
--cert, --key for TLS and mutual TLS (without a scheme, TLS is on when any
of them is given).
"""
import argparse
import os
import sys
import uuid

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from volume_reconciler.v1 import reconciler_pb2 as pb
from volume_reconciler.v1 import reconciler_pb2_grpc as rpc


def error_info(err: grpc.RpcError):
    """The ErrorInfo (reason, metadata) of a failed call, if any."""
    status = rpc_status.from_call(err)
    for detail in status.details if status else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason, dict(info.metadata)
    return None, {}


def read(path):
    with open(path, "rb") as f:
        return f.read()


def connect(args):
    """A channel and the metadata every call carries, from the options."""
    server, tls = args.server, bool(args.ca or args.cert or args.key)
    if server.startswith("https://"):
        server, tls = server[len("https://"):], True
    elif server.startswith("http://"):
        if tls:
            sys.exit("--ca/--cert/--key need TLS: write https://HOST:PORT or HOST:PORT")
        server = server[len("http://"):]
    if bool(args.cert) != bool(args.key):
        sys.exit("a client certificate needs its key: give both --cert and --key")
    if tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=read(args.ca) if args.ca else None,  # None: the system's roots
            private_key=read(args.key) if args.key else None,
            certificate_chain=read(args.cert) if args.cert else None,
        )
        channel = grpc.secure_channel(server, creds)
    else:
        channel = grpc.insecure_channel(server)
    token = args.token
    if args.token_file:
        if token:
            sys.exit("give --token or --token-file, not both")
        token = read(args.token_file).decode().strip()
    metadata = [("authorization", f"Bearer {token}")] if token else []
    return channel, metadata


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default=os.environ.get("VOLUME_RECONCILER_SERVER", "127.0.0.1:50051"))
    ap.add_argument("--token", default=os.environ.get("VOLUME_RECONCILER_TOKEN"), help="bearer token")
    ap.add_argument("--token-file", default=os.environ.get("VOLUME_RECONCILER_TOKEN_FILE"))
    ap.add_argument("--ca", default=os.environ.get("VOLUME_RECONCILER_CA"), help="CA (PEM) of the server's certificate")
    ap.add_argument("--cert", default=os.environ.get("VOLUME_RECONCILER_CERT"), help="client certificate (PEM), mutual TLS")
    ap.add_argument("--key", default=os.environ.get("VOLUME_RECONCILER_KEY"), help="key of the client certificate (PEM)")
    ap.add_argument("--server-id", default=str(uuid.uuid4()))
    ap.add_argument("--volume-id", default=str(uuid.uuid4()))
    ap.add_argument("--timeout", type=float, default=30.0, help="each call's deadline, seconds")
    args = ap.parse_args()

    channel, metadata = connect(args)
    stub = rpc.VolumeReconcilerStub(channel)
    call = {"timeout": args.timeout, "metadata": metadata}
    key = f"py-attach-{uuid.uuid4()}"
    req = pb.AttachVolumeRequest(idempotency_key=key, server_id=args.server_id, volume_id=args.volume_id)

    op = stub.AttachVolume(req, **call)
    print(f"attach {op.id}: {pb.State.Name(op.state)} ({pb.Resolution.Name(op.resolution)}), device {op.attachment.device}, caller {op.caller or '-'}")
    if op.state != pb.STATE_SUCCEEDED:
        return 1

    # A retry with the same key joins the same operation: never a second attach.
    again = stub.AttachVolume(req, **call)
    print(f"replay with the same key: same operation {again.id == op.id}")
    if again.id != op.id:
        return 1

    # The reconcile log tells why it ended as it did.
    for e in stub.ListOperationEvents(pb.ListOperationEventsRequest(operation_id=op.id), **call).events:
        print(f"  {e.kind:<14} {e.detail}")

    # Bad input: INVALID_ARGUMENT naming the field, in ErrorInfo.
    try:
        stub.AttachVolume(pb.AttachVolumeRequest(idempotency_key="k", server_id="nope", volume_id=args.volume_id), **call)
        return 1
    except grpc.RpcError as err:
        reason, meta = error_info(err)
        print(f"bad request: {err.code().name} {reason} field={meta.get('field')}")
        if err.code() != grpc.StatusCode.INVALID_ARGUMENT or meta.get("field") != "server_id":
            return 1

    det = stub.DetachVolume(
        pb.DetachVolumeRequest(idempotency_key=f"py-detach-{uuid.uuid4()}", server_id=args.server_id, volume_id=args.volume_id),
        **call,
    )
    print(f"detach {det.id}: {pb.State.Name(det.state)} ({pb.Resolution.Name(det.resolution)})")
    return 0 if det.state == pb.STATE_SUCCEEDED else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as err:
        reason, meta = error_info(err)
        detail = f", {reason}" + "".join(f" {k}={v}" for k, v in sorted(meta.items())) if reason else ""
        print(f"error: {err.details()} ({err.code().name}{detail})", file=sys.stderr)
        sys.exit(1)
