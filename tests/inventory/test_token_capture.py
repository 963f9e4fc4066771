"""What a tenant sniffing the provisioning network sees of an enrollment (issue 28, item 5;
the fast version: the whole boot path with QEMU, provisioning and a join is
tests/e2e/test_token_capture_lab.py, METALD_LAB_LONG=1).

metald (``metald serve``) in one namespace behind a bridge, a machine in another joined to
it: every frame on the bridge's ports is captured (``vmlab.capture``, a raw socket) while the
machine fetches its discovery script as iPXE does (the script carries its agent token on
the kernel command line) and the real discovery agent (busybox and curl, as in the image)
posts its inventory with that token. With ``[boot] tls_auto`` and the pin on the command line
the capture holds TLS and no secret; with plain HTTP (the control) the capture finds the
agent token in clear, which shows the capture and the search would have seen one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import waiting
from tests.inventory.conftest import AGENT, BOOT_ID
from tests.inventory.test_agent import BUSYBOX, xe9680
from tests.inventory.test_agent_https import image_bin  # noqa: F401  (fixture)
from vmlab.labnet import NEED_ROOT, ROOT, Netns, namespaces, veth

CURL = shutil.which("curl")
pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(not ROOT, reason=NEED_ROOT),
    pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed"),
    pytest.mark.skipif(CURL is None, reason="curl is not installed"),
]
METALD = Path(sys.executable).parent / "metald"
MAC = "52:54:00:77:00:01"
SERVER, NODE = "10.77.0.1", "10.77.0.50"


def _start_metald(lab: Netns, tmp: Path, tls: bool) -> subprocess.Popen[str]:
    assets = tmp / "assets"
    assets.mkdir()
    conf = tmp / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp / "state"}"\ninstance = "cap"\n[api]\nlisten = "127.0.0.1:8080"\n'
        f'[boot]\nenabled = true\ndhcp_mode = "off"\nserver_address = "{SERVER}"\n'
        f'assets_dir = "{assets}"\nrouter_advertisements = false\nscript_clients = "any"\n'
        f'http_listen = "{SERVER}:8443"\ntls_auto = {str(tls).lower()}\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("METALD_")}
    log = open(tmp / "metald.log", "w")  # noqa: SIM115 - the process's, closed with it
    proc = lab.popen(str(METALD), "serve", "--config", str(conf), stdout=log, stderr=log, env=env)
    token = tmp / "state" / "admin.token"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError((tmp / "metald.log").read_text()[-3000:])
        return token.exists() and _api(lab, tmp, "GET", "/api/v1/machines")[0] == 200

    waiting.wait_for("metald to start", up, 60, every=0.3)
    return proc


def _api(lab: Netns, tmp: Path, method: str, path: str, body: object = None) -> tuple[int, dict]:
    token = (tmp / "state" / "admin.token").read_text().strip()
    argv = ["curl", "-sS", "-m", "30", "-X", method, "-H", f"Authorization: Bearer {token}",
            "-w", "\n%{http_code}"]  # fmt: skip
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    r = lab.run(*argv, f"http://127.0.0.1:8080{path}", check=False)
    text, _, status = r.stdout.rpartition("\n")
    return int(status or 0), (json.loads(text) if text.strip() else {})


@pytest.mark.parametrize(
    "tls",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.skipif(
                os.environ.get("METALD_LAB_LONG") != "1",
                reason="the control (~25 s): METALD_LAB_LONG=1; test_capture_finds_a_token_"
                "cut_between_segments checks the search in make test",
            ),
        ),
    ],
    ids=["https", "plain-http-control"],
)
def test_an_enrollment_leaves_no_token_on_the_wire(
    tmp_path: Path,
    image_bin: Path,  # noqa: F811
    tls: bool,
) -> None:
    from vmlab.capture import secrets_in

    with namespaces("lab", "node") as ns:
        lab, node = ns["lab"], ns["node"]
        lab.run("ip", "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        lab.run("ip", "addr", "add", f"{SERVER}/24", "dev", "br0")
        lab.run("ip", "link", "set", "br0", "up")
        veth(lab, "vn0", "", node, "eth0", f"{NODE}/24")
        lab.run("ip", "link", "set", "vn0", "master", "br0")
        pcap, ready = tmp_path / "bridge.pcap", tmp_path / "capture.ready"
        cap = lab.popen(sys.executable, "-m", "vmlab.capture", str(pcap), str(ready))
        metald = None
        try:
            waiting.wait_for("the capture to start", ready.exists, 30, every=0.1)
            metald = _start_metald(lab, tmp_path, tls)
            st, m = _api(lab, tmp_path, "POST", "/api/v1/machines", {"macs": [MAC]})
            assert st == 201, m
            st, m = _api(lab, tmp_path, "POST", f"/api/v1/machines/{m['id']}/actions",
                         {"action": "inspect"})  # fmt: skip
            assert st == 200 and m["state"] == "inspecting", m

            # The script, as iPXE fetches it (metald's iPXE trusts only metald's CA)
            scheme = "https" if tls else "http"
            ca = ["--cacert", str(tmp_path / "state" / "boot-ca.pem")] if tls else []
            r = node.run("curl", "-sS", "-m", "30", *ca,
                         f"{scheme}://{SERVER}:8443/boot/{MAC}.ipxe")  # fmt: skip
            kernel = next(x for x in r.stdout.splitlines() if x.startswith("kernel "))
            args = dict(re.findall(r"(metald\.[a-z]+)=(\S+)", kernel))
            agent_token = args["metald.token"]
            assert agent_token.startswith("mtd_") and ("metald.ca" in args) == tls

            # The real agent posts its inventory with that token
            fs = xe9680(tmp_path / "root")
            fs.boot(BOOT_ID, " ".join(f"{k}={v}" for k, v in args.items()))
            env = {
                "PATH": str(image_bin),
                "METALD_SYSROOT": str(fs.root),
                "METALD_STATE_DIR": str(fs.root / "run"),
                "METALD_DRY_RUN": "1",
                "METALD_RETRY_MAX": "0",
                "METALD_MAX_TRIES": "3",
            }
            res = subprocess.run(
                ["ip", "netns", "exec", node.name, "env", "-i",
                 *(f"{k}={v}" for k, v in env.items()), str(BUSYBOX), "sh", str(AGENT)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            out = res.stdout + res.stderr
            assert "] inventory posted (" in out, out[-3000:]
        finally:
            cap.terminate()
            cap.wait(30)
            if metald is not None:
                metald.terminate()
                metald.wait(30)
    found = secrets_in(pcap, also=(agent_token.encode(), b"Authorization: Bearer"))
    print(
        f"\n{'https' if tls else 'http'}: {found.frames} frames, {found.connections} TCP "
        f"connections, {found.payload_bytes} B of payload, {len(found.hits)} secrets in clear"
    )
    assert 8443 in found.tcp_ports and found.connections >= 2
    if tls:
        assert found.hits == [], found.hits[:5]
    else:
        # the control: the capture and the search see a token sent in clear
        assert (f"tcp {SERVER}:8443 -> {NODE}", agent_token.encode()) in [
            (w.rsplit(":", 1)[0], s) for w, s in found.hits
        ], found.hits
        assert any(s == b"Authorization: Bearer" for _, s in found.hits)


def _pcap(path: Path, frames: list[bytes]) -> Path:
    import struct

    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1))
        for fr in frames:
            f.write(struct.pack("<IIII", 0, 0, len(fr), len(fr)) + fr)
    return path


def _tcp(seq: int, payload: bytes, sport: int = 8443, dport: int = 40000) -> bytes:
    import socket
    import struct

    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x18, 65535, 0, 0) + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0,
        socket.inet_aton(SERVER), socket.inet_aton(NODE),
    )  # fmt: skip
    return b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00" + ip + tcp


def test_capture_finds_a_token_cut_between_segments(tmp_path: Path) -> None:
    """The search joins each direction's segments in sequence order (given out of order and
    twice, as two bridge ports see them) before looking: a token cut in two is found whole;
    TLS-looking bytes give nothing."""
    from vmlab.capture import secrets_in

    token = b"mjt_" + b"A" * 43
    body = b"POST /api/v1/join HTTP/1.1\r\nAuthorization: Bearer " + token + b"\r\n\r\n"
    cut = body.index(token) + 10
    frames = [_tcp(1000 + cut, body[cut:]), _tcp(1000, body[:cut]), _tcp(1000, body[:cut])]
    found = secrets_in(_pcap(tmp_path / "a.pcap", frames), also=(b"Authorization: Bearer",))
    assert (f"tcp {SERVER}:8443 -> {NODE}:40000", token) in found.hits
    assert found.connections == 1 and found.tcp_ports == {8443, 40000}
    tls = [_tcp(1, b"\x17\x03\x03" + os.urandom(600))]
    assert secrets_in(_pcap(tmp_path / "b.pcap", tls)).hits == []
