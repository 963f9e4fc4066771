"""The node agent's health report (bootassets/node/metald-node, ``health_once``) end to end:
the shell collects from stand-in tools (a real nvidia-smi capture behind a stand-in
``nvidia-smi`` on PATH, a kernel log in /dev/kmsg's record format, a sysfs tree with InfiniBand
ports), posts to a small aiohttp server that records the body, and metald's own parser
(``metald.health.node.report_signals``) reads what was sent. Runs under busybox sh with
busybox's applets (nc, timeout, awk ...) first on PATH, as in the image."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web

from metald.health.node import NodeReport, report_signals
from metald.health.signals import Kind
from tests.bootassets.conftest import ROOT

SCRIPT = ROOT / "bootassets/node/metald-node"
A100_XML = ROOT / "tests/fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
FIELDS = {"version", "kernel_log", "nvidia_smi_xml", "nvlink", "smart", "ib_ports", "dcgm_health"}
APPLETS = ("nc", "timeout", "awk", "sed", "tr", "head", "tail", "wc", "cat", "od", "mkfifo")
TOKEN = "node-token-sekrit-0123456789"

pytestmark = pytest.mark.skipif(
    shutil.which("busybox") is None or shutil.which("jq") is None, reason="needs busybox and jq"
)

XID_LINE = "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, GPU has fallen off the bus."
NVLINK = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)\n\t Link 0: 25 GB/s\n\t Link 1: <inactive>\n"


@dataclass
class Server:
    url: str
    bodies: list[bytes] = field(default_factory=list)
    auth: list[str] = field(default_factory=list)
    #: (status, headers, json body) answered in turn; the last one repeats.
    answers: list[tuple[int, dict[str, str], dict]] = field(
        default_factory=lambda: [(200, {}, {"interval_s": 30})]
    )


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server(url="")

    async def report(request: web.Request) -> web.Response:
        srv.bodies.append(await request.read())
        srv.auth.append(request.headers.get("Authorization", ""))
        status, headers, body = srv.answers.pop(0) if len(srv.answers) > 1 else srv.answers[0]
        return web.json_response(body, status=status, headers=headers)

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/api/v1/health/report", report)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    srv.url = f"http://127.0.0.1:{port}/api/v1/health/report"
    yield srv
    await runner.cleanup()


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's world: busybox applets and stand-in tools on PATH, a kernel log, sysfs."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    busybox = shutil.which("busybox")
    assert busybox
    for a in APPLETS:
        (bin_ / a).symlink_to(busybox)
    (bin_ / "jq").symlink_to(shutil.which("jq") or "jq")
    (tmp_path / "state").mkdir()
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "kmsg").write_text("")
    return tmp_path


def stand_in(node: Path, name: str, script: str) -> None:
    p = node / "bin" / name
    p.write_text("#!/bin/sh\n" + script)
    p.chmod(0o755)


def nvidia_smi(node: Path, xml: Path, *, nvlink: str | None = NVLINK) -> None:
    (node / "nvlink.txt").write_text(nvlink or "")
    stand_in(
        node,
        "nvidia-smi",
        f'[ "$1" = -q ] && [ "$2" = -x ] && exec cat "{xml}"\n'
        + (f'[ "$1" = nvlink ] && exec cat "{node / "nvlink.txt"}"\n' if nvlink else "")
        + "echo 'NVIDIA-SMI has failed' && exit 9\n",
    )


def kmsg(node: Path, *records: tuple[int, str]) -> None:
    with (node / "kmsg").open("a") as f:
        for seq, msg in records:
            f.write(f"6,{seq},{seq * 1000 + 5},-;{msg}\n SUBSYSTEM=pci\n")


async def health_once(node: Path, srv: Server, first: Path | None = None) -> tuple[str, int]:
    """One ``health_once`` under busybox sh (``first``: a folder before the others on PATH);
    (its output, HEALTH_NEXT)."""
    env = {
        "PATH": f"{f'{first}:' if first else ''}{node / 'bin'}:/usr/bin:/bin",
        "METALD_NODE_LIB": "1",
        "METALD_NODE_STATE": str(node / "state"),
        "METALD_NODE_KMSG": str(node / "kmsg"),
        "METALD_NODE_SYS": str(node / "sys"),
    }
    body = f'. {SCRIPT}\nhealth_once "{srv.url}" "{node / "token"}"\necho "NEXT=$HEALTH_NEXT"\n'
    proc = await asyncio.create_subprocess_exec(
        "busybox",
        "sh",
        "-c",
        body,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, text
    assert TOKEN not in text
    return text, int(text.rsplit("NEXT=", 1)[1].strip())


def sent(srv: Server, i: int = -1) -> dict:
    doc = json.loads(srv.bodies[i])
    assert set(doc) == FIELDS
    assert doc["version"] == 1
    return doc


def parsed(doc: dict, gpu_count: int | None):  # type: ignore[no-untyped-def]
    report = NodeReport(
        at=datetime.now(UTC),
        **{k: v for k, v in doc.items() if k != "version"},
    )
    return report_signals(report, gpu_count=gpu_count)


async def test_a_real_capture_reaches_metalds_parser(node: Path, server: Server) -> None:
    nvidia_smi(node, A100_XML)
    kmsg(node, (1, "eth0: link up"), (2, XID_LINE), (3, "EDAC MC0: 1 CE memory read error"))
    ib = node / "sys/class/infiniband/mlx5_0/ports"
    for port, state in (("1", "4: ACTIVE"), ("2", "1: DOWN")):
        (ib / port).mkdir(parents=True)
        (ib / port / "state").write_text(state + "\n")
        (ib / port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    out, nxt = await health_once(node, server)
    assert nxt == 30  # the answer's interval_s
    assert server.auth == [f"Bearer {TOKEN}"]
    doc = sent(server)
    assert doc["nvidia_smi_xml"] == A100_XML.read_text()  # byte for byte, through jq
    assert doc["nvlink"] == NVLINK
    assert doc["smart"] is None  # no smartctl on PATH
    assert "eth0" not in doc["kernel_log"]
    assert XID_LINE in doc["kernel_log"] and "EDAC MC0" in doc["kernel_log"]
    sig = parsed(doc, gpu_count=2)
    assert sig.unreadable == []
    found = {(s.kind, s.subject, s.code) for s in sig.signals}
    assert (Kind.XID, "0000:01:00", "79") in found
    assert (Kind.GPU_COUNT, "node", "missing") in found  # the capture describes one GPU
    assert (Kind.NVLINK, "GPU 0 link 1", "inactive") in found
    assert (Kind.IB_PORT, "mlx5_0/2", "down") in found
    assert not any(s.subject == "mlx5_0/1" for s in sig.signals)
    gpu = {s.code for s in sig.signals if s.kind == Kind.GPU_ECC}
    assert gpu == {"correctable-aggregate"}  # the capture's GPU is healthy


async def test_dcgmi_health_is_sent_where_dcgmi_runs(node: Path, server: Server) -> None:
    failed = (
        ROOT
        / "tests/health/fixtures/dcgmi-health-c-j_derived_gpu1-dbe-failure_gpu0-pcie-warning.json"
    )
    stand_in(node, "dcgmi", f'[ "$1 $2 $3" = "health -c -j" ] && exec cat "{failed}"\nexit 1\n')
    await health_once(node, server)
    doc = sent(server)
    assert doc["dcgm_health"] == failed.read_text()
    found = {(s.kind, s.subject, s.code) for s in parsed(doc, gpu_count=None).signals}
    assert (Kind.DCGM_HEALTH, "GPU 1", "failure") in found
    # watches not set: dcgmi fails, and the field is null
    stand_in(node, "dcgmi", "echo 'Error: Health watches not enabled.'\nexit 1\n")
    await health_once(node, server)
    assert sent(server)["dcgm_health"] is None


async def test_awkward_bytes_are_escaped_and_come_back_unchanged(
    node: Path, server: Server
) -> None:
    xml = node / "odd.xml"
    odd = '<nvidia_smi_log note="a \\"q\\" \\\\ b">\ttab\r\n\u00e9\u4e2d\U0001f600 </x>\x01\x1f\n'
    xml.write_bytes(odd.encode() + b"bad utf-8 \xff, a NUL \x00.\n")
    nvidia_smi(node, xml, nvlink=None)
    kmsg(node, (7, 'mce: [Hardware Error]: "quoted" \\ back\tslash \u00e9'))
    await health_once(node, server)
    doc = sent(server)
    assert doc["nvidia_smi_xml"] == odd + "bad utf-8 \ufffd, a NUL .\n"
    assert doc["nvlink"] is None  # nvidia-smi nvlink failed: null, not its error text
    assert doc["kernel_log"] == '[0.007005] mce: [Hardware Error]: "quoted" \\ back\tslash \u00e9\n'
    # metald says what it could not read, and reads the rest
    assert parsed(doc, gpu_count=1).unreadable[0].startswith("nvidia-smi -q -x: not XML")


async def test_a_kernel_line_is_reported_once_and_again_after_a_failed_post(
    node: Path, server: Server
) -> None:
    kmsg(node, (1, XID_LINE))
    ok = (200, {}, {"interval_s": 20})
    server.answers = [ok, ok, (503, {}, {"title": "busy"}), ok]
    await health_once(node, server)
    assert XID_LINE in sent(server, 0)["kernel_log"]
    await health_once(node, server)  # nothing new
    assert sent(server, 1)["kernel_log"] == ""
    kmsg(node, (2, "EDAC MC1: 1 UE memory read error"))
    out, nxt = await health_once(node, server)  # 503: kept for the next report
    assert nxt == 15 and "status 503: busy" in out  # the default interval
    await health_once(node, server)
    assert sent(server, 2)["kernel_log"] == sent(server, 3)["kernel_log"]
    assert (
        "EDAC MC1" in sent(server, 3)["kernel_log"]
        and XID_LINE not in sent(server, 3)["kernel_log"]
    )
    await health_once(node, server)
    assert sent(server, 4)["kernel_log"] == ""


async def test_429_retry_after_sets_the_next_report(node: Path, server: Server) -> None:
    kmsg(node, (1, XID_LINE))
    server.answers = [
        (429, {"Retry-After": "42"}, {"title": "too early"}),
        (200, {}, {"interval_s": 15}),
    ]
    out, nxt = await health_once(node, server)
    assert nxt == 42 and "wait 42 s" in out
    _, nxt = await health_once(node, server)
    assert nxt == 15
    for asked, got in ((0, 1), (7200, 3600), (10**6, 3600), (10**20, 15), ("soon", 15), (2.9, 2)):
        server.answers = [(200, {}, {"interval_s": asked})]
        _, nxt = await health_once(node, server)
        assert nxt == got, asked
    assert XID_LINE in sent(server, 1)["kernel_log"]  # refused reports lose no line


async def test_missing_tools_give_null_and_a_refused_token_stops(
    node: Path, server: Server
) -> None:
    await health_once(node, server)
    doc = sent(server)
    assert doc == {**doc, "nvidia_smi_xml": None, "nvlink": None, "smart": None, "ib_ports": None}
    assert doc["kernel_log"] == ""
    assert parsed(doc, gpu_count=None).signals == []
    server.answers = [(401, {}, {"detail": "node token revoked"})]
    env = {
        "PATH": f"{node / 'bin'}:/usr/bin:/bin",
        "METALD_NODE_LIB": "1",
        "METALD_NODE_STATE": str(node / "state"),
        "METALD_NODE_KMSG": str(node / "kmsg"),
    }
    proc = await asyncio.create_subprocess_exec(
        "busybox",
        "sh",
        "-c",
        f'. {SCRIPT}\nhealth_once "{server.url}" "{node / "token"}"; echo "rc=$?"',
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert b"rc=1" in out and b"node token refused" in out


async def test_smartctl_output_reaches_the_parser(node: Path, server: Server) -> None:
    (node / "sys/block/nvme0n1").mkdir(parents=True)
    (node / "sys/block/loop0").mkdir(parents=True)
    doc = {
        "device": {"name": "/dev/nvme0n1"},
        "model_name": "Sample NVMe",
        "smart_status": {"passed": False},
        "nvme_smart_health_information_log": {"critical_warning": 4, "media_errors": 3},
    }
    (node / "smart.json").write_text(json.dumps(doc, indent=2))
    # smartctl's exit status is a bit mask of findings (8: failing disk): the JSON counts
    stand_in(node, "smartctl", f'cat "{node / "smart.json"}"\nexit 8\n')
    await health_once(node, server)
    sig = parsed(sent(server), gpu_count=None)
    assert {(s.kind, s.code) for s in sig.signals} == {
        (Kind.SMART, "failed"),
        (Kind.SMART, "critical-warning"),
        (Kind.SMART, "media-errors"),
    }
    assert sent(server)["smart"].count("\n") == 1  # one disk (loop0 skipped), one line


async def test_an_oversized_tool_output_is_null_and_the_body_fits(
    node: Path, server: Server
) -> None:
    big = node / "big.xml"
    big.write_text("<nvidia_smi_log>" + "x" * 600_000 + "</nvidia_smi_log>\n")
    nvidia_smi(node, big, nvlink=None)
    kmsg(node, *((i, f"EDAC MC0: {i} CE error {'y' * 200}") for i in range(1, 1001)))
    await health_once(node, server)
    doc = sent(server)
    assert doc["nvidia_smi_xml"] is None
    assert len(doc["kernel_log"].encode()) <= 65536
    assert doc["kernel_log"].startswith("[") and "EDAC MC0: 1000 CE" in doc["kernel_log"]
    assert len(server.bodies[-1]) <= 1 << 20


def test_the_agent_starts_the_health_loop_after_the_join() -> None:
    text = SCRIPT.read_text()
    run = text[text.index("\nrun() {") :]
    assert run.index("start_health") > run.index("start_mesh")
    assert os.path.basename(str(SCRIPT)) == "metald-node"


@pytest.mark.parametrize(
    ("mode", "found"),
    [
        ("healthy", set()),
        ("missing-gpu", {(Kind.GPU_COUNT, "missing")}),
        (
            "uncorrectable-ecc",
            {(Kind.GPU_ECC, f"uncorrectable-{s}") for s in ("volatile", "aggregate")},
        ),
    ],
)
async def test_the_lab_gpu_standin_through_the_agent(
    node: Path, server: Server, mode: str, found: set
) -> None:
    from vmlab import faults

    standin = faults.install_gpu_standin(node / "gpu", A100_XML.read_text(), mode)
    await health_once(node, server, first=standin)
    sig = parsed(sent(server), gpu_count=1)
    assert sig.unreadable == []
    faulty = {(s.kind, s.code) for s in sig.signals if s.code != "correctable-aggregate"}
    assert faulty == found
