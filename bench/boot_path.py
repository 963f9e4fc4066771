"""Power-on to ``ready`` for one lab machine, broken down from real sources.

    sudo .venv/bin/python bench/boot_path.py [--runs 3] [--firmware bios|uefi-rom|uefi-pxe]
        [--ipxe debian|built|both] [--https [--https-assets]]

Brings up a vm-lab rack of one machine with metald inside (as ``make demo`` does, commissioning
off), registers its BMC, powers it on through metald, and waits for ``ready``. Meanwhile:

- a packet sniffer on the lab bridge (AF_PACKET, inside the lab's namespace) stamps every DHCP
  message, TFTP read request and transfer, and HTTP request with its response size and the time
  its last byte left metald;
- the machine's serial log is followed and each line stamped with the host's clock when it
  appeared (SeaBIOS, iPXE, the kernel, /init and the agent all write there);
- the virtual BMC's command log gives the time it received the power-on;
- metald's events (its SQLite database) give each state change.

All on the host's clock, printed as seconds after the power-on command. ``--firmware uefi-pxe``
boots an OVMF machine whose NIC has no iPXE ROM, so the firmware's own PXE loads snponly.efi;
``uefi-rom`` an OVMF machine with the NIC's (Debian's) iPXE ROM, ``bios`` SeaBIOS with it.
``--https``: metald's own iPXE behind a provisioning listener (``[boot] http_listen``) with
the lab CA as metald's tls_auto CA, so its script, the image signatures and the agent go over
HTTPS (tls_auto and require_https on by default) and the kernel and initrd over the plain-HTTP
asset listener (``[boot] assets_http_listen``), each checked by iPXE's ``imgverify`` before it
boots (``--https-assets``: those over HTTPS too, as before that listener); Debian's iPXE runs
over plain HTTP.
``--ipxe built`` hands out metald's own iPXE (bootassets/ipxe.py, built with the lab's CA on
first use and cached; vmlab.labipxe) instead of Debian's; ``both`` alternates the two run by
run and prints a median for each (it matters where the firmware loads iPXE: ``uefi-pxe``; BIOS
machines run the NIC's iPXE ROM).
The lab is torn down after each run; labs are named per process so this can run next to others.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sqlite3
import statistics
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

ETH_P_ALL = 0x0003
DHCP_TYPES = {1: "DISCOVER", 2: "OFFER", 3: "REQUEST", 4: "DECLINE", 5: "ACK", 6: "NAK", 7: "RELEASE", 8: "INFORM"}  # fmt: skip


# ---- packets: a pure decoder, and the sniffer that feeds it ------------------------------------


def decode(ts: float, frame: bytes) -> dict[str, Any] | None:
    """One Ethernet frame -> a small record (DHCP, TFTP, TCP to/from the boot servers), or None."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    proto = ip[9]
    src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
    total = struct.unpack("!H", ip[2:4])[0]
    l4 = ip[ihl:total]
    if proto == 17 and len(l4) >= 8:
        sport, dport = struct.unpack("!HH", l4[:4])
        payload = l4[8:]
        if {sport, dport} & {67, 68} and len(payload) >= 240:
            mac = ":".join(f"{b:02x}" for b in payload[28:34])
            msg = _dhcp_type(payload[240:])
            return {"t": ts, "k": "dhcp", "mac": mac, "type": DHCP_TYPES.get(msg, str(msg))}
        if len(payload) >= 4:
            op = struct.unpack("!H", payload[:2])[0]
            if dport == 69 and op == 1:
                name = payload[2:].split(b"\0", 1)[0].decode(errors="replace")
                return {"t": ts, "k": "tftp-rrq", "peer": f"{src}:{sport}", "file": name}
            if op == 3:  # DATA from the server's transfer port to the client
                return {"t": ts, "k": "tftp-data", "peer": f"{dst}:{dport}", "n": len(payload) - 4}
        return None
    if proto == 6 and len(l4) >= 20:
        sport, dport = struct.unpack("!HH", l4[:4])
        seq, ack = struct.unpack("!II", l4[4:12])
        off = (l4[12] >> 4) * 4
        flags, window = l4[13], struct.unpack("!H", l4[14:16])[0]
        payload = l4[off:]
        if payload[:4] in (b"GET ", b"POST", b"HEAD"):
            line = payload.split(b"\r\n", 1)[0].decode(errors="replace")
            return {"t": ts, "k": "http-req", "conn": f"{src}:{sport}", "line": line}
        # seq/ack/window/flags for both directions (pure ACKs included): losses and
        # retransmissions show in them (a TCP RTO backs off 0.2, 0.4, 0.8 ... s).
        seg = {"seq": seq, "ack": ack, "win": window, "fl": flags, "n": len(payload)}
        if not payload:
            return {"t": ts, "k": "tcp-ack", "conn": f"{src}:{sport}", **seg}
        return {"t": ts, "k": "tcp", "conn": f"{dst}:{dport}", **seg}
    return None


def _dhcp_type(options: bytes) -> int:
    i = 0
    while i < len(options) and options[i] != 255:
        if options[i] == 0:
            i += 1
            continue
        if i + 1 >= len(options):
            break
        code, length = options[i], options[i + 1]
        if code == 53 and length >= 1 and i + 2 < len(options):
            return options[i + 2]
        i += 2 + length
    return 0


def sniff(iface: str, out: Path) -> None:
    """Write a JSON line per decoded frame seen on ``iface`` until killed."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((iface, 0))
    with open(out, "a", buffering=1) as f:
        while True:
            frame, addr = s.recvfrom(65535)
            rec = decode(time.time(), frame)
            if rec is not None:
                f.write(json.dumps(rec) + "\n")


@dataclass
class Transfer:
    what: str
    start: float
    #: when the last new byte of the response first left the server (a retransmission of bytes
    #: already sent does not move it)
    end: float
    #: response bytes, each counted once
    size: int
    #: TCP segments sent again after they had been sent once, and when the last of them left
    retx: int = 0
    last_retx: float | None = None


def transfers(records: list[dict[str, Any]]) -> list[Transfer]:
    """TFTP reads and HTTP requests with their response bytes (server to client) and the time of
    the last byte; a connection's bytes belong to its latest request (keep-alive).

    TCP segments that carry only bytes already sent (by sequence number) are retransmissions:
    counted apart, not added to the size and not moving ``end``. A client that stops ACKing
    the tail of a response it already has (iPXE under UEFI does while the kernel's EFI stub
    runs, until ExitBootServices) makes the server retransmit it for seconds; counting those
    as the transfer made a 0.7 s download look like 4-8 s at 2-5 MB/s."""
    out: list[Transfer] = []
    by_peer: dict[str, Transfer] = {}
    sent_to: dict[str, int] = {}  # per connection: sequence number after the highest byte sent
    for r in records:
        if r["k"] == "tftp-rrq":
            by_peer[r["peer"]] = t = Transfer("TFTP " + r["file"], r["t"], r["t"], 0)
            out.append(t)
        elif r["k"] == "tftp-data" and r["peer"] in by_peer:
            t = by_peer[r["peer"]]
            t.size += r["n"]
            t.end = r["t"]
        elif r["k"] == "http-req":
            path = r["line"].split(" ")[1] if " " in r["line"] else r["line"]
            method = r["line"].split(" ", 1)[0]
            by_peer[r["conn"]] = t = Transfer(
                f"HTTP {method} {path.split('?')[0]}", r["t"], r["t"], 0
            )
            out.append(t)
        elif r["k"] == "tcp" and r["conn"] in by_peer:
            t = by_peer[r["conn"]]
            if "seq" not in r:  # a record without sequence numbers: count it all
                t.size += r["n"]
                t.end = r["t"]
                continue
            end = r["seq"] + r["n"]
            hi = sent_to.get(r["conn"])
            new = r["n"] if hi is None else (end - hi) % (1 << 32)
            if hi is not None and (new == 0 or new > r["n"]):  # nothing beyond what was sent
                t.retx += 1
                t.last_retx = r["t"]
                continue
            sent_to[r["conn"]] = end % (1 << 32)
            t.size += new
            t.end = r["t"]
    return out


def client_fins(records: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """(time, connection) of the first FIN on each connection that fetched /boot/ (iPXE's; the
    agent's API connections are left out). iPXE closes its
    connections when it shuts down: under BIOS right before it jumps to the kernel, under UEFI
    when the kernel's EFI stub calls ExitBootServices (after the stub has decompressed the
    kernel), so this marks the end of the firmware's part."""
    http = {r["conn"] for r in records if r["k"] == "http-req" and " /boot/" in r["line"]}
    out, seen = [], set()
    for r in records:
        fin = r["k"] == "tcp-ack" and r.get("fl", 0) & 0x01
        if fin and r["conn"] in http and r["conn"] not in seen:
            seen.add(r["conn"])
            out.append((r["t"], r["conn"]))
    return out


# ---- the serial console ------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SerialFollower(threading.Thread):
    """Stamps each line of a growing serial log with the host time it appeared and the CPU time
    the machine's QEMU had used by then: on a loaded host the wall clock stretches, while the
    guest's CPU seconds (TCG emulates every instruction on the host) mostly do not."""

    def __init__(self, path: Path, qemu_pid: int) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.qemu_pid = qemu_pid
        self.lines: list[tuple[float, str]] = []
        self.cpu: dict[float, float] = {}
        #: (host time, QEMU CPU seconds) every poll, to read the CPU used by any event's time
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def cpu_at(self, t: float) -> float:
        """QEMU's CPU seconds at host time ``t`` (the last sample at or before it)."""
        before = [c for ts, c in self.samples if ts <= t]
        return before[-1] if before else float("nan")

    def run(self) -> None:
        pos, buf = 0, b""
        while not self.stop.is_set():
            try:
                with open(self.path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            now = time.time()
            self.samples.append((now, cpu_seconds(self.qemu_pid)))
            if chunk:
                self.cpu[now] = cpu_seconds(self.qemu_pid)
                pos += len(chunk)
                buf += chunk
                *done, buf = buf.replace(b"\r", b"\n").split(b"\n")
                self.lines += [(now, ln.decode(errors="replace")) for ln in done if ln.strip()]
            self.stop.wait(0.02)


#: (label, substring) of serial lines worth a row, first occurrence each.
SERIAL_MARKS = [
    ("firmware starts (SeaBIOS/OVMF)", ("SeaBIOS (version", "BdsDxe", "UEFI")),
    ("firmware PXE (>>Start PXE)", (">>Start PXE",)),
    ("iPXE starts", ("iPXE initialising", "iPXE 1.")),
    ("iPXE configuring net0", ("Configuring (net0",)),
    ("iPXE fetches script", ("/boot/52", ".ipxe...")),
    ("iPXE has the kernel", ("discovery/vmlinuz...",)),
    ("iPXE has the initrd", ("discovery/initrd.img...",)),
    ("iPXE has the signatures (HTTPS)", ("/boot/signatures/discovery/initrd.img...",)),
    ("kernel: Linux version", ("Linux version",)),
    ("kernel: unpacking initramfs", ("Unpacking initramfs", "Trying to unpack")),
    ("kernel: freeing initrd memory", ("Freeing initrd memory",)),
    ("kernel: Run /init", ("Run /init",)),
    ("/init: discovery image up", ("discovery image up",)),
    ("/init: drivers loaded", ("drivers loaded",)),
    ("/init: DHCP address", (") has ",)),
    ("agent: collecting inventory", ("collecting inventory",)),
    ("agent: inventory collected", ("inventory collected",)),
    ("agent: inventory posted", ("inventory posted",)),
    ("agent: next action", ("next action",)),
]


_UPTIME = re.compile(r"metald-agent: \[(\d+\.\d+)\] discovery image up")


def serial_marks(lines: list[tuple[float, str]]) -> list[tuple[float, str, str]]:
    out = []
    for label, needles in SERIAL_MARKS:
        for t, line in lines:
            if any(n in line for n in needles):
                out.append((t, label, line.strip()[:90]))
                break
    # The kernel prints nothing with "quiet"; /init's first line carries its uptime, so the
    # kernel's clock started that long before (what lies between the last byte of the initrd and
    # this is the kernel's decompression: in the EFI stub under UEFI, before ExitBootServices).
    for t, line in lines:
        if m := _UPTIME.search(line):
            uptime = float(m.group(1))
            out.append((t - uptime, "kernel clock starts (/init's uptime back)", f"{uptime} s"))
            break
    return out


# ---- one run -----------------------------------------------------------------------------------


@dataclass
class Run:
    t0: float
    rows: list[tuple[float, str, str]] = field(default_factory=list)
    ready: float | None = None
    userspace: float | None = None
    #: QEMU's CPU seconds from power-on to the discovery image's userspace
    cpu_userspace: float | None = None
    #: power-on -> the firmware's first DHCPDISCOVER: wall seconds and QEMU CPU seconds
    first_discover: float | None = None
    cpu_first_discover: float | None = None
    boot_order: str = "disk-first"
    #: whose iPXE DHCP handed out: "debian" or "built" (metald's own)
    ipxe: str = "debian"


def metald_events(db: Path, t0: float) -> list[tuple[float, str, str]]:
    from datetime import UTC, datetime

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "select at, kind, from_state, to_state, reason from events order by id"
        ).fetchall()
    finally:
        con.close()
    out = []
    for at, kind, frm, to, reason in rows:
        ts = datetime.fromisoformat(at)
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=UTC)
        t = ts.timestamp()
        if t < t0 - 1:
            continue
        what = f"{frm} -> {to}" if to else (reason or "")[:60]
        out.append((t, f"metald event {kind}", what))
    return out


def variant_assets(initrd: Path, into: Path) -> Path:
    """The current boot assets with ``initrd`` as the discovery initramfs (compare image
    variants without a rebuild); commissioning's image is left out (commissioning is off)."""
    import shutil

    from bootassets.build import ensure_built

    src = ensure_built()
    (into / "discovery").mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copyfile(f, into / f.name)
    shutil.copyfile(src / "discovery" / "vmlinuz", into / "discovery" / "vmlinuz")
    shutil.copyfile(initrd, into / "discovery" / "initrd.img")
    return into


def one_run(
    workdir: Path,
    firmware: str,
    keep: bool = False,
    initrd: Path | None = None,
    uefi_file: str | None = None,
    boot_order: str = "disk-first",
    ipxe: str = "debian",
    https: bool = False,
    https_assets: bool = False,
    bios_file: str | None = None,
) -> Run:
    import bootassets.build
    from vmlab.rack import LabRack

    real_ensure_built = bootassets.build.ensure_built
    assets = None
    if initrd is not None:
        assets = variant_assets(initrd, workdir / "assets")
    if ipxe == "built":
        from vmlab.labipxe import assets_with_built_ipxe

        assets = assets_with_built_ipxe(assets or real_ensure_built(), workdir / "assets-ipxe")
    if assets is not None:
        bootassets.build.ensure_built = lambda *a, **k: assets  # type: ignore[assignment]
    boot_config = f'ipxe = "{ipxe}"\n'
    if https and ipxe == "built":
        from vmlab.labipxe import seed_state

        seed_state(workdir / "metald")  # metald's tls_auto CA: the one its iPXE trusts
        boot_config += 'http_listen = "0.0.0.0:8443"\n'
        if not https_assets:  # kernel and initrd over plain HTTP, signatures over HTTPS
            boot_config += 'assets_http_listen = "0.0.0.0:8082"\n'
    if uefi_file:
        boot_config += f'uefi_x64_file = "{uefi_file}"\n'
    if bios_file:
        boot_config += f'bios_file = "{bios_file}"\n'

    name = f"bp{os.getpid() % 100000}"
    rack = LabRack(
        name,
        workdir,
        machines=1,
        uefi=0 if firmware == "bios" else 1,
        nic_rom=firmware != "uefi-pxe",
        # Both iPXEs on the same hardware: a virtio RNG, which metald's iPXE seeds TLS from.
        rng=True,
        boot_config=boot_config,
    )
    bootassets.build.ensure_built = real_ensure_built  # type: ignore[assignment]
    follower = None
    try:
        m = rack.machines[0]
        pcap = workdir / "packets.jsonl"
        rack.lab.spawn(
            [
                sys.executable,
                __file__,
                "sniff",
                "--iface",
                rack.state["bridge"],
                "--out",
                str(pcap),
            ],
            role="sniffer",
            log=workdir / "sniffer.log",
        )
        qemu_pid = next(p["pid"] for p in rack.state["processes"] if p["role"] == "qemu")
        follower = SerialFollower(Path(m["serial_log"]), qemu_pid)
        follower.start()
        bmc = rack.register_bmcs(["ipmi"])[m["name"]]
        if boot_order == "nic-first":
            # What an operator of a PXE-provisioned fleet sets once: network first, persistent
            # (metald's script answers a machine that should boot its disk with "exit", which
            # falls through to the next boot device). Set on the BMC, as a technician would.
            b = m["bmc"]
            rack.lab.run(
                ["ipmitool", "-I", "lanplus", "-C", "3", "-H", b["address"], "-p",
                 str(b["ipmi_port"]), "-U", b["username"], "-P", b["password"],
                 "chassis", "bootdev", "pxe", "options=persistent,efiboot"],
                check=True, capture_output=True,
            )  # fmt: skip
        time.sleep(0.5)  # the sniffer's socket is bound well before it
        t0 = time.time()
        cpu0 = cpu_seconds(qemu_pid)
        rack.ctl("bmcs", "power", bmc["id"], "on")
        t_cmd_done = time.time()
        ready = rack.wait_state([m["mac"]], "ready", 300)
        t_ready_seen = time.time() - (time.monotonic() - ready[m["mac"]])
        time.sleep(0.3)
        follower.stop.set()
        run = Run(t0)
        run.rows.append((t_cmd_done, "metalctl bmcs power on returned", ""))
        for line in Path(m["bmc_commands"]).read_text().splitlines():
            c = json.loads(line)
            if c["t"] >= t0 - 1:
                run.rows.append((c["t"], f"BMC received {c['command']}", f"via {c['face']}"))
        records = [json.loads(x) for x in pcap.read_text().splitlines() if x.strip()]
        run.boot_order = boot_order
        run.ipxe = ipxe
        for r in records:
            if r["k"] == "dhcp" and r["mac"] == m["mac"]:
                run.rows.append((r["t"], f"DHCP {r['type']}", ""))
                if r["type"] == "DISCOVER" and run.first_discover is None:
                    run.first_discover = r["t"] - t0
                    run.cpu_first_discover = follower.cpu_at(r["t"]) - cpu0
        for tr in transfers(records):
            run.rows.append((tr.start, f"{tr.what} requested", ""))
            if tr.size:
                rate = tr.size / max(tr.end - tr.start, 1e-3) / 1e6
                retx = (
                    f"; {tr.retx} segments sent again, the last at +{tr.last_retx - t0:.2f} s"
                    if tr.last_retx is not None
                    else ""
                )
                run.rows.append(
                    (
                        tr.end,
                        f"{tr.what} sent",
                        f"{tr.size / 1e6:.2f} MB in {tr.end - tr.start:.2f} s ({rate:.1f} MB/s)"
                        + retx,
                    )
                )
        for t, conn in client_fins(records):
            run.rows.append((t, "client FIN (iPXE shuts down)", conn))
        run.rows += [
            (t, label, f"[qemu cpu {follower.cpu_at(t) - cpu0:6.2f} s] {line}")
            for t, label, line in serial_marks(follower.lines)
        ]
        events = metald_events(rack.state_dir / "metald.db", t0)
        run.rows += events
        run.rows.append((t_ready_seen, "bench saw ready (API poll)", ""))
        run.rows.sort(key=lambda r: r[0])
        readies = [t for t, what, detail in events if detail.endswith("-> ready")]
        run.ready = (readies[0] if readies else t_ready_seen) - t0
        ups = [t for t, label, _ in run.rows if label.startswith("/init: discovery image up")]
        run.userspace = ups[0] - t0 if ups else None
        cpu_ups = [
            follower.cpu[t] - cpu0
            for t, ln in follower.lines
            if "discovery image up" in ln and t in follower.cpu
        ]
        run.cpu_userspace = cpu_ups[0] if cpu_ups else None
        taps = rack.lab.run(
            ["ip", "-s", "-s", "link", "show", m["tap"]], capture_output=True, text=True
        )
        (workdir / "tap.txt").write_text(taps.stdout + taps.stderr)
        (workdir / "serial.txt").write_text(
            "\n".join(f"{t - t0:8.3f} {ln}" for t, ln in follower.lines)
        )
        return run
    finally:
        if follower is not None:
            follower.stop.set()
        if not keep:
            rack.down()


def print_run(run: Run) -> None:
    print(f"{'t (s)':>8}  {'step':<44} detail")
    for t, label, detail in run.rows:
        print(f"{t - run.t0:8.3f}  {label:<44} {detail}")
    print(
        f"power-on -> discovery userspace {run.userspace if run.userspace is not None else float('nan'):.1f} s,"
        f" -> ready {run.ready:.1f} s; QEMU CPU to userspace {run.cpu_userspace or float('nan'):.1f} s;"
        f" first DHCPDISCOVER at {run.first_discover or float('nan'):.1f} s"
        f" (QEMU CPU {run.cpu_first_discover or float('nan'):.1f} s);"
        f" load {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    sn = sub.add_parser("sniff")
    sn.add_argument("--iface", required=True)
    sn.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--firmware", choices=("bios", "uefi-rom", "uefi-pxe"), default="bios")
    ap.add_argument(
        "--https",
        action="store_true",
        help="metald's own iPXE over HTTPS (a provisioning listener with the lab CA)",
    )
    ap.add_argument(
        "--https-assets",
        action="store_true",
        help="with --https: kernel and initrd over HTTPS too (default: over the plain-HTTP asset"
        " listener, boot.assets_http_listen, each checked by iPXE's imgverify)",
    )
    ap.add_argument("--keep", action="store_true", help="leave the lab up (one run)")
    ap.add_argument(
        "--boot-order",
        choices=("disk-first", "nic-first", "both"),
        default="disk-first",
        help="the machine's standing boot order (nic-first: set persistent PXE on its BMC first);"
        " both: alternate the two run by run, one median each",
    )
    ap.add_argument(
        "--ipxe",
        choices=("debian", "built", "both"),
        default="debian",
        help="whose iPXE DHCP hands out: Debian's, metald's own build (bootassets/ipxe.py), or"
        " both, alternating run by run, one median each",
    )
    ap.add_argument("--initrd", type=Path, help="boot this discovery initramfs instead")
    ap.add_argument("--save", type=Path, help="copy each run's serial log and packets here")
    ap.add_argument(
        "--uefi-file",
        help="[boot] uefi_x64_file for this run (default snponly.efi; ipxe.efi: native drivers)",
    )
    ap.add_argument(
        "--bios-file",
        help="[boot] bios_file for this run (default undionly.kpxe: the NIC ROM's PXE stack;"
        " ipxe.pxe: iPXE's own drivers, no real-mode call per packet)",
    )
    args = ap.parse_args()
    if args.cmd == "sniff":
        sniff(args.iface, args.out)
        return
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, taps, QEMU)")
    runs = []
    orders = ["disk-first", "nic-first"] if args.boot_order == "both" else [args.boot_order]
    ipxes = ["debian", "built"] if args.ipxe == "both" else [args.ipxe]
    combos = [(o, x) for o in orders for x in ipxes]
    for i in range(args.runs):
        order, ipxe = combos[i % len(combos)]
        with tempfile.TemporaryDirectory(prefix="boot-path-") as d:
            run = one_run(
                Path(d),
                args.firmware,
                keep=args.keep,
                initrd=args.initrd,
                uefi_file=args.uefi_file,
                boot_order=order,
                ipxe=ipxe,
                https=args.https,
                https_assets=args.https_assets,
                bios_file=args.bios_file,
            )
            if args.save:
                dest = args.save / f"run{i + 1}"
                dest.mkdir(parents=True, exist_ok=True)
                for f in ("serial.txt", "packets.jsonl", "metald.log", "tap.txt"):
                    if (Path(d) / f).exists():
                        (dest / f).write_bytes((Path(d) / f).read_bytes())
            print(f"\n== run {i + 1}/{args.runs} ({args.firmware}, {order}, {WHOSE[ipxe]} iPXE)")
            print_run(run)
            runs.append(run)
    for order, ipxe in combos:
        mine = [r for r in runs if (r.boot_order, r.ipxe) == (order, ipxe)]
        if len(mine) > 1:
            print_medians(f"{args.firmware}, {order}, {WHOSE[ipxe]} iPXE", mine)


WHOSE = {"debian": "Debian's", "built": "metald's"}


def print_medians(name: str, runs: list[Run]) -> None:
    def med(values: list[float | None]) -> str:
        got = [v for v in values if v is not None]
        return (
            f"{statistics.median(got):.1f} (all: {', '.join(f'{v:.1f}' for v in got)})"
            if got
            else "-"
        )

    print(
        f"\nmedian of {len(runs)} ({name}): power-on -> userspace "
        f"{med([r.userspace for r in runs])} s, -> ready {med([r.ready for r in runs])} s,"
        f" QEMU CPU to userspace {med([r.cpu_userspace for r in runs])} s; first DHCPDISCOVER"
        f" {med([r.first_discover for r in runs])} s, QEMU CPU to it"
        f" {med([r.cpu_first_discover for r in runs])} s"
    )


if __name__ == "__main__":
    main()
