"""Teardown after crashes, and labs side by side.

``down`` must remove everything (processes, namespace, bridge, taps, files, slot) using only
what the state file and the namespace tell it, whatever killed the process that built the lab.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import lab_prerequisites
from .labtools import (
    VM_LAB,
    assert_lab_gone,
    host_links,
    in_ns,
    ipmitool,
    netns,
    plan,
    procs,
    qmp,
    redfish,
    system_path,
    vlab,
    wait_state,
)

pytestmark = [pytest.mark.lab, pytest.mark.root]


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    reason = lab_prerequisites()
    if reason:
        pytest.skip(reason)


def _cli(home: Path, *args: str, **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen(
        [*VM_LAB, "--home", str(home), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **kwargs,
    )


def _down(home: Path, name: str) -> None:
    done = subprocess.run(
        [*VM_LAB, "--home", str(home), "down", "--name", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def _recorded_alive(state: dict[str, Any]) -> list[int]:
    return [
        p["pid"]
        for p in state["processes"]
        if procs.same_process(p["pid"], p["start_time"]) and procs.is_running(p["pid"])
    ]


def _wait_in_namespace(pid: int, ns: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while pid not in netns.pids(ns):
        assert time.monotonic() < deadline, f"process {pid} never entered namespace {ns}"
        time.sleep(0.02)


def test_down_after_kill_9_of_the_lab_driver_and_of_a_daemon_inside(tmp_path: Path) -> None:
    name = f"t{os.getpid()}k"
    driver = _cli(tmp_path, "up", "--machines", "2", "--uefi", "1", "--name", name, "--foreground")
    state_path = tmp_path / name / "state.json"
    try:
        state = wait_state(state_path, lambda s: s["status"] == "up")
        # A stand-in for metald: started inside the lab, recorded nowhere, then killed -9.
        daemon = subprocess.Popen(
            netns.exec_argv(state["netns"], ["sleep", "600"]), start_new_session=True
        )
        # nsenter joins the namespace after fork: wait until it has, or the check below races.
        _wait_in_namespace(daemon.pid, state["netns"])
        crashed = subprocess.Popen(netns.exec_argv(state["netns"], ["sleep", "600"]))
        crashed.kill()
        crashed.wait()

        driver.kill()
        driver.wait()
        # The lab outlives its driver: QEMU and the BMCs still run, the namespace is there.
        assert len(_recorded_alive(state)) == 4
        assert netns.exists(state["netns"])
        assert daemon.pid in netns.pids(state["netns"])

        _down(tmp_path, name)
        assert_lab_gone(name, state, tmp_path / name)
        assert daemon.wait(timeout=10) is not None
    finally:
        if driver.poll() is None:
            driver.kill()
        vlab.Lab(name, workdir=tmp_path).down()


def test_down_after_kill_9_in_the_middle_of_up(tmp_path: Path) -> None:
    name = f"t{os.getpid()}m"
    driver = _cli(tmp_path, "up", "--machines", "2", "--uefi", "1", "--name", name)
    state_path = tmp_path / name / "state.json"
    try:
        # Kill it as soon as it has started its first process, long before the lab is up.
        state = wait_state(state_path, lambda s: len(s["processes"]) >= 1)
        driver.kill()
        driver.wait()
        state = vlab.read_state(state_path)
        assert state["status"] == "building"
        _down(tmp_path, name)
        assert_lab_gone(name, state, tmp_path / name)
    finally:
        if driver.poll() is None:
            driver.kill()
        vlab.Lab(name, workdir=tmp_path).down()


def test_foreground_lab_goes_down_on_sigterm(tmp_path: Path) -> None:
    name = f"t{os.getpid()}f"
    driver = _cli(tmp_path, "up", "--machines", "1", "--uefi", "0", "--name", name, "--foreground")
    try:
        state = wait_state(tmp_path / name / "state.json", lambda s: s["status"] == "up", 180)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 0
        assert_lab_gone(name, state, tmp_path / name)
    finally:
        if driver.poll() is None:
            driver.kill()
        vlab.Lab(name, workdir=tmp_path).down()


def test_second_lab_runs_beside_the_first(lab: vlab.Lab, tmp_path: Path) -> None:
    first = lab.state
    second = vlab.Lab(f"t{os.getpid()}b", machines=1, uefi=0, workdir=tmp_path, cpus=1)
    second.up()
    try:
        other = second.state
        assert other["slot"] != first["slot"]
        assert other["netns"] != first["netns"]
        assert other["bridge"] != first["bridge"]
        assert other["subnet"] != first["subnet"]
        first_macs = {m["mac"] for m in first["machines"]}
        assert not first_macs & {m["mac"] for m in other["machines"]}

        m_new = other["machines"][0]
        assert "Chassis Power is off" in ipmitool(other, m_new, "power", "status")
        assert redfish(other, m_new, "GET", system_path(m_new))[0] == 200
        # The second lab's BMC addresses are not reachable from the first lab's namespace.
        code = subprocess.run(
            ["ip", "netns", "exec", first["netns"], "curl", "-s", "-m", "3",
             m_new["bmc"]["redfish_url"] + "/redfish/v1/"],
            capture_output=True,
        ).returncode  # fmt: skip
        assert code != 0
    finally:
        second_state = second.state
        second.down()
    assert_lab_gone(second.name, second_state, tmp_path / second.name)
    # Taking the second lab down left the first one alone.
    m_old = first["machines"][0]
    assert netns.exists(first["netns"])
    assert "Chassis Power" in ipmitool(first, m_old, "power", "status")


def test_down_of_a_lab_that_never_existed_is_harmless(tmp_path: Path) -> None:
    vlab.Lab(f"t{os.getpid()}n", workdir=tmp_path).down()
    assert not (tmp_path / f"t{os.getpid()}n").exists()


def test_up_refuses_a_name_already_in_use(lab: vlab.Lab, tmp_path: Path) -> None:
    # Another home, same name: the namespace name is host-wide, so this must be refused.
    with pytest.raises(vlab.LabError):
        vlab.Lab(lab.name, machines=1, workdir=tmp_path).up()
    assert netns.exists(lab.netns)


def test_down_by_name_removes_a_namespace_left_without_state(tmp_path: Path) -> None:
    # As after a crash that also lost the lab's files: only the namespace and a process in it.
    name = f"t{os.getpid()}o"
    ns = plan.netns_name(name)
    netns.create(ns)
    sleeper = subprocess.Popen(netns.exec_argv(ns, ["sleep", "600"]))
    try:
        # Popen returns once nsenter is forked, before it has joined the namespace; down() can
        # only find a process that is in it (the first CI run raced here).
        deadline = time.monotonic() + 10
        while sleeper.pid not in netns.pids(ns):
            assert time.monotonic() < deadline, "sleeper never entered the namespace"
            time.sleep(0.02)
        assert name in vlab.list_labs(tmp_path)
        vlab.Lab(name, workdir=tmp_path).down()
        assert sleeper.wait(timeout=10) is not None
        assert not netns.exists(ns)
        assert name not in vlab.list_labs(tmp_path)
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        netns.delete(ns)


def test_attached_namespace_reaches_the_bmcs_and_goes_with_the_lab(tmp_path: Path) -> None:
    rack = vlab.Lab(f"t{os.getpid()}h", machines=1, uefi=0, workdir=tmp_path, cpus=1)
    rack.up()
    try:
        hub = rack.add_namespace("hub")
        assert hub["netns"] == f"{rack.netns}+hub"
        assert hub["address"].endswith(".240") and hub["peer"] in netns.links(hub["netns"])
        assert hub["veth"] in netns.links(rack.netns) and hub["veth"] not in host_links()
        # From the attached namespace the machines' BMCs are on-link.
        m0 = rack.state["machines"][0]
        url = m0["bmc"]["redfish_url"] + "/redfish/v1/"
        done = in_ns(hub["netns"], ["curl", "-s", "-m", "10", url])
        assert done.returncode == 0 and json.loads(done.stdout)["Systems"]
        daemon = subprocess.Popen(netns.exec_argv(hub["netns"], ["sleep", "600"]))
        with pytest.raises(vlab.LabError):
            rack.add_namespace("hub")
        state = dict(rack.state)
    finally:
        rack.down()
    assert daemon.wait(timeout=10) is not None
    assert not netns.exists(hub["netns"])
    assert hub["veth"] not in host_links() and hub["peer"] not in host_links()
    assert_lab_gone(rack.name, state, tmp_path / rack.name)


def test_a_machine_with_three_nics_and_two_disks(tmp_path: Path) -> None:
    """The data NICs sit on the lab's second bridge, the boot NIC alone on the boot bridge; QEMU
    has every NIC with its MAC and every disk with its serial; down removes all of it."""
    import asyncio

    rack = vlab.Lab(f"t{os.getpid()}d", machines=1, uefi=0, workdir=tmp_path, cpus=1, nics=3, disks=2)  # fmt: skip
    state = rack.up()
    try:
        (m,) = state["machines"]
        boot_br, data_br = state["bridge"], state["data_bridge"]
        out = in_ns(rack.netns, ["ip", "-o", "link", "show", "master", data_br]).stdout
        assert sorted(n["tap"] for n in m["extra_nics"]) == sorted(
            line.split(":")[1].strip() for line in out.splitlines()
        ), out
        out = in_ns(rack.netns, ["ip", "-o", "link", "show", "master", boot_br]).stdout
        assert m["tap"] in out and not any(n["tap"] in out for n in m["extra_nics"]), out
        assert not in_ns(rack.netns, ["ip", "-o", "addr", "show", "dev", data_br]).stdout.count(
            "inet "
        )
        tree = asyncio.run(qmp(m, "human-monitor-command", {"command-line": "info qtree"}))
        for mac in [m["mac"], *(n["mac"] for n in m["extra_nics"])]:
            assert f'mac = "{mac}"' in tree, mac
        assert tree.count("dev: virtio-blk-pci") == 2, tree
        assert [Path(d).exists() for d in m["extra_disks"]] == [True]
        blocks = asyncio.run(qmp(m, "query-block"))
        files = {b["inserted"]["file"] for b in blocks if b.get("inserted")}
        assert {m["disk"], *m["extra_disks"]} <= files, files
    finally:
        rack.down()
    assert_lab_gone(rack.name, state, tmp_path / rack.name)
    assert data_br not in host_links()
