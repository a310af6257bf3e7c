#!/usr/bin/env python3
"""Attach and detach a volume through volume-reconciler from Python.

Uses the standard grpcio package and stubs generated from the published
proto (examples/python/run.sh does both). Shows the three things an
orchestrator needs: an idempotency key per intent (retrying with the same
key is always safe), a deadline on every call, and reading the
google.rpc.ErrorInfo of a failure (its reason and metadata, e.g. the
operation_id to look up later).
"""
import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--server-id", default=str(uuid.uuid4()))
    ap.add_argument("--volume-id", default=str(uuid.uuid4()))
    ap.add_argument("--timeout", type=float, default=30.0, help="each call's deadline, seconds")
    args = ap.parse_args()

    stub = rpc.VolumeReconcilerStub(grpc.insecure_channel(args.server))
    key = f"py-attach-{uuid.uuid4()}"
    req = pb.AttachVolumeRequest(idempotency_key=key, server_id=args.server_id, volume_id=args.volume_id)

    op = stub.AttachVolume(req, timeout=args.timeout)
    print(f"attach {op.id}: {pb.State.Name(op.state)} ({pb.Resolution.Name(op.resolution)}), device {op.attachment.device}")
    if op.state != pb.STATE_SUCCEEDED:
        return 1

    # A retry with the same key joins the same operation: never a second attach.
    again = stub.AttachVolume(req, timeout=args.timeout)
    print(f"replay with the same key: same operation {again.id == op.id}")
    if again.id != op.id:
        return 1

    # The reconcile log tells why it ended as it did.
    for e in stub.ListOperationEvents(pb.ListOperationEventsRequest(operation_id=op.id), timeout=args.timeout).events:
        print(f"  {e.kind:<14} {e.detail}")

    # Bad input: INVALID_ARGUMENT naming the field, in ErrorInfo.
    try:
        stub.AttachVolume(pb.AttachVolumeRequest(idempotency_key="k", server_id="nope", volume_id=args.volume_id), timeout=args.timeout)
        return 1
    except grpc.RpcError as err:
        reason, meta = error_info(err)
        print(f"bad request: {err.code().name} {reason} field={meta.get('field')}")
        if err.code() != grpc.StatusCode.INVALID_ARGUMENT or meta.get("field") != "server_id":
            return 1

    det = stub.DetachVolume(
        pb.DetachVolumeRequest(idempotency_key=f"py-detach-{uuid.uuid4()}", server_id=args.server_id, volume_id=args.volume_id),
        timeout=args.timeout,
    )
    print(f"detach {det.id}: {pb.State.Name(det.state)} ({pb.Resolution.Name(det.resolution)})")
    return 0 if det.state == pb.STATE_SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
