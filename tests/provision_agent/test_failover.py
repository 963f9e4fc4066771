"""The agent outlives the metald instance that booted it: a deploy whose instance dies midway
finishes through another instance of ``metald.urls`` (both serve the same store, so the token
is good at either), and an HTTP error answer is an answer, not a reason to move on."""

from __future__ import annotations

import hashlib
import os

from tests.inventory.receiver import Receiver
from tests.provision_agent.conftest import MIB, cloud_image, needs_root_and_busybox, run_agent
from tests.provision_agent.server import AgentApi

pytestmark = needs_root_and_busybox


def _provision(image_url: str, image: bytes) -> dict:
    return {
        "action": "provision",
        "machine_id": "m1",
        "image": {
            "id": "img1",
            "kind": "disk",
            "url": image_url,
            "sha256": hashlib.sha256(image).hexdigest(),
            "format": "raw",
            "size_bytes": len(image),
        },
        "nocloud": {"meta-data": "{}\n", "user-data": "#cloud-config\n", "network-config": ""},
    }


async def test_deploy_finishes_through_the_next_instance_when_the_first_dies(
    tmp_path, busybox_bin, loops, instances
):
    image = cloud_image(tmp_path)
    # One store behind both: the progress both record is one list, the token good at both.
    a_api = AgentApi()
    b_api = AgentApi(image=image, progress=a_api.progress)
    a = await instances(a_api)
    b = await instances(b_api)
    a_api.provision = b_api.provision = _provision(f"{b.url}/image", image)
    # Instance a dies right after answering the first progress report of the write.
    a_api.on_progress = lambda n: a.kill() if n == 1 else None
    unrelated = await instances(AgentApi())  # listens, but is on no list: never sees the token
    disk = tmp_path / "disk.img"
    disk.write_bytes(os.urandom(8 * MIB))
    dev = loops.attach(disk)

    rc, log = await run_agent(
        tmp_path,
        busybox_bin,
        0,
        "deploy",
        METALD_URL=a.url,
        METALD_URLS=f"{b.url}/,not-a-url,{a.url}",
        METALD_DISKS=dev,
        METALD_PARTITIONS=loops.attach(disk, "-o", str(MIB), "--sizelimit", str(4 * MIB)),
        METALD_CHUNK_MB="1",
        METALD_PROGRESS_S="0",
        METALD_MAX_TRIES="1",  # no retry loop to hide behind: the failover itself carries it
    )
    assert rc == 0, log
    assert f"metald at {a.url} does not answer; going on with {b.url}" in log
    assert a_api.progress[-1] == {"phase": "deploy", "done": True}, log
    assert not any("error" in p for p in a_api.progress), a_api.progress
    # a answered the provision call and the first report, b everything after it
    assert len(a_api.seen_auth) == 2, a_api.seen_auth
    assert len(b_api.seen_auth) >= 3
    assert set(a_api.seen_auth + b_api.seen_auth) == {"Bearer agent-token"}
    assert unrelated.api.seen_auth == []  # type: ignore[attr-defined]
    loops.detach_all()
    assert disk.read_bytes()[:MIB] == image[:MIB]


async def test_an_http_error_answer_does_not_move_the_agent_on(
    tmp_path, busybox_bin, loops, instances
):
    a_api = AgentApi(token="another-token")  # answers 401 to this agent's token
    b_api = AgentApi()
    a = await instances(a_api)
    b = await instances(b_api)
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(2 * MIB))
    rc, log = await run_agent(
        tmp_path,
        busybox_bin,
        0,
        "deploy",
        METALD_URL=a.url,
        METALD_URLS=b.url,
        METALD_DISKS=loops.attach(disk),
        METALD_MAX_TRIES="1",
    )
    assert rc != 0
    assert "does not answer" not in log
    assert b_api.seen_auth == [], log
    assert a_api.seen_auth  # it did ask a, and took its 401 as the answer


async def test_an_inventory_refused_with_409_is_not_posted_again(tmp_path, busybox_bin, instances):
    """The post the dead instance accepted but never answered reaches the survivor again,
    which refuses it (409: the machine left inspection): the agent asks what next instead of
    posting it forever."""
    rec = Receiver(post_statuses=[409], actions=[{"action": "poweroff"}])
    inst = await instances(rec)
    rc, log = await run_agent(
        tmp_path, busybox_bin, 0, "", METALD_URL=inst.url, METALD_MAX_TRIES="3"
    )
    assert rc == 0, log
    assert [p["status"] for p in rec.posts] == [409], log
    assert rec.next_calls == 1 and "dry run: would poweroff" in log
