#!/usr/bin/env python3
"""Drive the simulator (`volume-reconciler nova-sim`) with openstacksdk, the
way a real OpenStack client does: authenticate against its Keystone,
discover Nova's and Cinder's versions from the catalog, list servers,
create a volume, attach and detach it through Nova, and follow it in
Cinder until each change is usable, then delete it.

It is the proof that the simulator answers what real clients expect
(version documents, catalog, project-scoped paths, microversion headers);
examples/python/openstack.sh sets up the environment and runs it.

Prints one line per step (`step: ...`); exits non-zero with the SDK's error
when a step fails.
"""
import argparse
import sys
import time

import openstack
from keystoneauth1 import discover


def wait_for(what, timeout, check):
    """Polls `check` (every 0.1 s) until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def attached_to(volume, server_id):
    return [a for a in volume.attachments or [] if a.get("server_id") == server_id]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--auth-url", required=True)
    p.add_argument("--username", default="demo")
    p.add_argument("--password", default="secret")
    p.add_argument("--project", default="demo")
    p.add_argument("--region", default="RegionOne")
    p.add_argument("--server-name", required=True, help="a server the simulator lists")
    p.add_argument("--timeout", type=float, default=30)
    args = p.parse_args()

    conn = openstack.connect(
        auth_url=args.auth_url,
        username=args.username,
        password=args.password,
        project_name=args.project,
        user_domain_name="Default",
        project_domain_name="Default",
        region_name=args.region,
    )
    print(f"token: project {conn.current_project_id}")
    # Version discovery: the endpoints and microversions the SDK settled on.
    compute = conn.compute.get_endpoint_data()
    block = conn.block_storage.get_endpoint_data()
    for name, data in (("compute", compute), ("block-storage", block)):
        print(f"{name}: {data.url} max {discover.version_to_string(data.max_microversion)}")

    servers = [s for s in conn.compute.servers() if s.name == args.server_name]
    if len(servers) != 1:
        raise SystemExit(f"expected one server named {args.server_name}, got {servers}")
    server = servers[0]
    print(f"server: {server.id} {server.status}")

    volume = conn.block_storage.create_volume(size=1, name="vr-openstacksdk")
    print(f"created: {volume.id} {volume.status}")
    volume = conn.block_storage.wait_for_status(
        volume, status="available", failures=["error"], interval=0.1, wait=args.timeout
    )
    print(f"ready: {volume.status}")

    attachment = conn.compute.create_volume_attachment(server, volume=volume)
    print(f"attach answered: device {attachment.device} volume {attachment.volume_id}")
    volume = wait_for(
        "the volume in use by the server",
        args.timeout,
        lambda: (v := conn.block_storage.get_volume(volume.id)).status == "in-use"
        and attached_to(v, server.id)
        and v,
    )
    (mine,) = attached_to(volume, server.id)
    print(f"attached: {volume.status} {mine['device']} attachment {mine['attachment_id']}")
    listed = list(conn.compute.volume_attachments(server))
    print(f"nova lists: {[a.volume_id for a in listed]}")

    conn.compute.delete_volume_attachment(server, volume)
    volume = wait_for(
        "the volume available again",
        args.timeout,
        lambda: (v := conn.block_storage.get_volume(volume.id)).status == "available" and v,
    )
    print(f"detached: {volume.status} attachments {volume.attachments}")

    conn.block_storage.delete_volume(volume)
    conn.block_storage.wait_for_delete(volume, interval=0.1, wait=args.timeout)
    print("deleted: the volume is gone")
    print("OK")


if __name__ == "__main__":
    try:
        main()
    except openstack.exceptions.SDKException as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
