"""Real BMC peers for the tests, each started fresh per test on a free loopback port:
OpenIPMI ``ipmi_sim`` (lanplus), sushy-tools' ``sushy-emulator`` with its fake driver (with and
without basic auth), and pyghmi BMC servers that misbehave on purpose (``fault_bmc.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vmlab import labnet

HERE = Path(__file__).parent
PASSWORD = "s3cr3t-Pa55word-x9"
SYSTEM_UUID = "a1234567-89ab-cdef-0123-456789abcdef"


def free_port(kind: socket.SocketKind = socket.SOCK_DGRAM) -> int:
    """A free loopback port, UDP (IPMI's) unless told otherwise."""
    return labnet.free_port(kind)


def udp_bound(port: int, addr: str = "127.0.0.1", pid: int | None = None) -> bool:
    """Whether a socket of this network namespace (of process ``pid``, when given) is bound to
    UDP ``addr:port`` or to the wildcard on ``port``, read from ``/proc/net/udp``: looking
    never takes the port itself."""
    want = {socket.inet_aton(addr)[::-1].hex().upper(), "00000000"}
    inodes = set()
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        fields = line.split()
        ip, _, hexport = fields[1].partition(":")
        if int(hexport, 16) == port and ip in want:
            inodes.add(fields[9])
    if pid is None or not inodes:
        return bool(inodes)
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


def _wait_udp_bound(
    port: int, proc: subprocess.Popen, timeout: float = 10.0, addr: str = "127.0.0.1"
) -> None:
    """Wait until ``proc`` has bound its UDP port. The probe reads the socket table: it used to
    bind the port itself to see whether it was taken, and a peer starting in that instant found
    the port held by the probe and exited 1 (a CI run lost a test to it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited with {proc.returncode}")
        if udp_bound(port, addr, proc.pid):
            return
        time.sleep(0.05)
    raise RuntimeError("peer did not bind its port")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _full_sensor_record(number: int, name: str) -> str:
    """An SDR type 0x01 (full sensor record, IPMI spec table 43-1): a threshold temperature
    sensor in degrees C with reading = raw (M=1, B=0)."""
    body = [
        0x20,
        0x00,
        number,
        0x03,
        0x01,
        0x7F,
        0x68,
        0x01,
        0x01,
        0,
        0,
        0,
        0,
        0,
        0,
        0x00,
        0x01,
        0x00,
        0x00,
        0x01,
        0x00,
        0x00,
        0x00,
        0x00,
        0x00,
        0x00,
        0x28,
        0x50,
        0x0A,
        0xFF,
        0x00,
        0x64,
        0x5A,
        0x50,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0xC0 | len(name),
        *name.encode(),
    ]
    return " ".join(f"0x{b:02x}" for b in [0, 0, 0x51, 0x01, len(body), *body])


#: The simulated BMC: one temperature sensor reading 45 C, and one SEL entry.
EMU = f"""mc_setbmc 0x20
mc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02
main_sdr_add 0x20 {_full_sensor_record(1, "CPU Temp")}
sensor_add 0x20 0 1 0x01 0x01
sensor_set_value 0x20 0 1 45 0
sel_enable 0x20 1000 0x0a
sel_add 0x20 0x02 0x00 0x00 0x00 0x60 0x20 0x00 0x04 0x01 0x01 0x01 0x59 0x5a 0x5a
mc_enable 0x20
"""


@dataclass
class IpmiSim:
    port: int
    username: str
    password: str
    calls_file: Path
    system_uuid: str

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def ipmitool(self, *args: str) -> str:
        """Run ipmitool against this BMC over IPMI 2.0 (cipher suite 3), as an operator
        would, behind metald's back; its output."""
        cmd = ["ipmitool", "-I", "lanplus", "-C", "3", "-H", "127.0.0.1", "-p", str(self.port),
               "-U", self.username, "-P", self.password, *args]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout


_PORTS_GIVEN: set[int] = set()


def _udp_port() -> int:
    """A UDP port (ipmi_sim listens on UDP) free now and never handed to another simulator of
    this process: a port probed free over TCP and released at once could be given twice (a
    test's six BMCs once got the same port, and registering the second answered 409)."""
    while True:
        port = free_port(socket.SOCK_DGRAM)
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def start_ipmi_sim(
    tmp_path: Path, *, power_on: bool = False, addr: str = "127.0.0.1"
) -> tuple[IpmiSim, subprocess.Popen]:
    """An ``ipmi_sim`` in ``tmp_path`` on a free port. Its chassis script logs every command
    (``IpmiSim.calls``); while the file ``hold-off`` exists in ``tmp_path`` a power-off is
    logged but not applied (a machine slow to go off)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    # The port is probed free, then released for ipmi_sim to bind: another process's socket can
    # take it in between, and ipmi_sim then exits 1. So a sim that exits before it binds is
    # started again on another port; its stderr says why.
    for attempt in range(5):
        try:
            return _start_ipmi_sim_on(_udp_port(), tmp_path, power_on=power_on, addr=addr)
        except _ExitedEarly:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


class _ExitedEarly(RuntimeError):
    pass


def _start_ipmi_sim_on(
    port: int, tmp_path: Path, *, power_on: bool, addr: str
) -> tuple[IpmiSim, subprocess.Popen]:
    calls, power = tmp_path / "calls.log", tmp_path / "power"
    if power_on:
        power.write_text("1\n")
    hold = tmp_path / "hold-off"
    script = tmp_path / "chassis.sh"
    # ipmi_sim runs this for every chassis command: the test reads what the BMC was asked.
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {calls}
        if [ "$1" = get ]; then
          shift
          for p in "$@"; do
            [ "$p" = power ] && echo "power:$(cat {power} 2>/dev/null || echo 0)"
            [ "$p" = boot ] && echo "boot:default"
          done
        elif [ "$1" = set ] && [ "$2" = power ]; then
          [ "$3" = 0 ] && [ -e {hold} ] && exit 0
          echo "$3" > {power}
        fi
        exit 0
        """)
    )
    script.chmod(0o755)
    guid = SYSTEM_UUID.replace("-", "")
    (tmp_path / "lan.conf").write_text(
        textwrap.dedent(f"""\
        name "sim"
        set_working_mc 0x20
          startlan 1
            addr {addr} {port}
            priv_limit admin
            allowed_auths_callback none md2 md5 straight
            allowed_auths_user none md2 md5 straight
            allowed_auths_operator none md2 md5 straight
            allowed_auths_admin none md2 md5 straight
            guid {guid}
          endlan
          chassis_control "{script}"
          user 2 true  "admin" "{PASSWORD}" admin 10 none md2 md5 straight
        """)
    )
    (tmp_path / "bmc.emu").write_text(EMU)
    (tmp_path / "ipmi-sim-state").mkdir(exist_ok=True)
    log = tmp_path / "ipmi_sim.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                "ipmi_sim",
                "-n",
                "-c",
                str(tmp_path / "lan.conf"),
                "-f",
                str(tmp_path / "bmc.emu"),
                "-s",
                str(tmp_path / "ipmi-sim-state"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        _wait_udp_bound(port, proc, addr=addr)
    except RuntimeError as e:
        _stop(proc)
        if proc.returncode is not None and "exited" in str(e):
            tail = log.read_text(errors="replace")[-500:]
            raise _ExitedEarly(f"ipmi_sim on port {port} exited {proc.returncode}: {tail}") from e
        raise
    except BaseException:
        _stop(proc)
        raise
    return IpmiSim(port, "admin", PASSWORD, calls, SYSTEM_UUID), proc


def stop_peer(proc: subprocess.Popen) -> None:
    _stop(proc)


@pytest.fixture
def ipmi_sim(tmp_path: Path) -> Iterator[IpmiSim]:
    if shutil.which("ipmi_sim") is None:
        pytest.skip("ipmi_sim (Debian package openipmi) is not installed")
    sim, proc = start_ipmi_sim(tmp_path)
    try:
        yield sim
    finally:
        _stop(proc)


@dataclass
class Sushy:
    port: int
    username: str | None
    password: str | None
    system_uuid: str
    mac: str


_SUSHY_MAIN = """
import sys
import sushy_tools.emulator.resources.systems.fakedriver as fake
# The fake driver applies power changes 1-11 s later, at random; tests want a known delay
# (none unless the test asks for one).
delay = int(sys.argv[2]) if len(sys.argv) > 2 else 0
fake.random.randint = lambda a, b: delay
from sushy_tools.emulator.main import main
sys.argv = ["sushy-emulator", "--config", sys.argv[1]]
sys.exit(main())
"""


def make_tls_pair(tmp_path: Path) -> tuple[Path, Path, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (cert file, key file, CA PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test BMC CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "bmc.crt", tmp_path / "bmc.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file, ca.public_bytes(serialization.Encoding.PEM).decode()


def _start_sushy(
    tmp_path: Path, auth: bool, tls: tuple[Path, Path] | None = None, power_delay_s: int = 0
) -> tuple[subprocess.Popen, Sushy]:
    port = free_port(socket.SOCK_STREAM)
    sys_uuid = str(uuid.uuid4())
    mac = "52:54:00:aa:bb:01"
    conf = tmp_path / "sushy.conf"
    lines = [
        "SUSHY_EMULATOR_FAKE_DRIVER = True",
        f"SUSHY_EMULATOR_FAKE_SYSTEMS = [{{'uuid': '{sys_uuid}', 'name': 'node-1', "
        f"'power_state': 'Off', 'nics': [{{'mac': '{mac}', 'ip': '10.0.0.5'}}]}}]",
        "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'",
        f"SUSHY_EMULATOR_LISTEN_PORT = {port}",
        f"SUSHY_EMULATOR_STATE_DIR = '{tmp_path / 'sushy-state'}'",
    ]
    user = pw = None
    if auth:
        import bcrypt

        user, pw = "admin", PASSWORD
        htpasswd = tmp_path / "htpasswd"
        htpasswd.write_text(f"{user}:{bcrypt.hashpw(pw.encode(), bcrypt.gensalt(4)).decode()}\n")
        lines.append(f"SUSHY_EMULATOR_AUTH_FILE = '{htpasswd}'")
    if tls:
        lines.append(f"SUSHY_EMULATOR_SSL_CERT = '{tls[0]}'")
        lines.append(f"SUSHY_EMULATOR_SSL_KEY = '{tls[1]}'")
    conf.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SUSHY_MAIN, str(conf), str(power_delay_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            raise RuntimeError("sushy-emulator exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > end:
                _stop(proc)
                raise RuntimeError("sushy-emulator did not start") from None
            time.sleep(0.1)
    return proc, Sushy(port, user, pw, sys_uuid, mac)


@pytest.fixture
def sushy(tmp_path: Path) -> Iterator[Sushy]:
    proc, peer = _start_sushy(tmp_path, auth=False)
    try:
        yield peer
    finally:
        _stop(proc)


@pytest.fixture
def sushy_slow(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Sushy]:
    """sushy-emulator applying power changes ``request.param`` seconds after it accepted them
    (as the stock emulator does, 1-11 s at random; real BMCs too)."""
    proc, peer = _start_sushy(tmp_path, auth=False, power_delay_s=int(request.param))
    try:
        yield peer
    finally:
        stop_peer(proc)


@pytest.fixture
def sushy_tls(tmp_path: Path) -> Iterator[tuple[Sushy, str]]:
    cert, key, ca_pem = make_tls_pair(tmp_path)
    proc, peer = _start_sushy(tmp_path, auth=True, tls=(cert, key))
    try:
        yield peer, ca_pem
    finally:
        _stop(proc)


@pytest.fixture
def sushy_auth(tmp_path: Path) -> Iterator[Sushy]:
    proc, peer = _start_sushy(tmp_path, auth=True)
    try:
        yield peer
    finally:
        _stop(proc)


class FaultBmc:
    """A pyghmi BMC server in its own process; ``controls()`` lists the chassis controls it ran."""

    def __init__(self, tmp_path: Path, mode: str, password: str = PASSWORD) -> None:
        self.port = free_port()
        self.password = password
        self.out = tmp_path / f"fault-{mode}-{self.port}.out"
        self._fh = self.out.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fault_bmc.py"), str(self.port), mode, password],
            stdin=subprocess.DEVNULL,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        _wait_udp_bound(self.port, self.proc)

    def controls(self) -> list[str]:
        return [ln for ln in self.out.read_text().splitlines() if ln.startswith("control")]

    def stop(self) -> None:
        _stop(self.proc)
        self._fh.close()


@pytest.fixture
def fault_bmc(tmp_path: Path) -> Iterator:
    started: list[FaultBmc] = []

    def start(mode: str, password: str = PASSWORD) -> FaultBmc:
        b = FaultBmc(tmp_path, mode, password)
        started.append(b)
        return b

    try:
        yield start
    finally:
        for b in started:
            b.stop()


class SessionRedfish:
    """A small Redfish service for the two paths sushy-emulator lacks: a SessionService
    (X-Auth-Token sessions, expiry) and actions answered 202 with a task monitor. It also
    advertises a narrow ResetType list, so the driver's choice of reset types is exercised."""

    def __init__(
        self,
        password: str = PASSWORD,
        reset_types: tuple[str, ...] = ("On", "PowerCycle"),
        task_polls: int = 2,
    ) -> None:
        self.password = password
        self.reset_types = reset_types
        self.task_polls = task_polls
        self.tokens: set[str] = set()
        self.resets: list[str] = []
        self.logins = 0
        self.deleted = 0
        self.power = "Off"
        self._polls = 0

    def app(self) -> Any:
        from aiohttp import web

        sysp = "/redfish/v1/Systems/1"

        def authed(request: web.Request) -> bool:
            return request.headers.get("X-Auth-Token") in self.tokens

        async def root(request: web.Request) -> web.Response:
            return web.json_response(
                {
                    "@odata.id": "/redfish/v1/",
                    "Systems": {"@odata.id": "/redfish/v1/Systems"},
                    "Links": {"Sessions": {"@odata.id": "/redfish/v1/SessionService/Sessions"}},
                }
            )

        async def login(request: web.Request) -> web.Response:
            body = await request.json()
            if body.get("UserName") != "admin" or body.get("Password") != self.password:
                return web.json_response({"error": {"message": "bad credentials"}}, status=401)
            self.logins += 1
            token = f"tok-{self.logins}"
            self.tokens.add(token)
            return web.json_response(
                {},
                status=201,
                headers={
                    "X-Auth-Token": token,
                    "Location": f"/redfish/v1/SessionService/Sessions/{self.logins}",
                },
            )

        async def logout(request: web.Request) -> web.Response:
            self.deleted += 1
            return web.Response(status=204)

        async def systems(request: web.Request) -> web.Response:
            if not authed(request):
                return web.Response(status=401)
            return web.json_response({"Members": [{"@odata.id": sysp}]})

        async def system(request: web.Request) -> web.Response:
            if not authed(request):
                return web.Response(status=401)
            return web.json_response(
                {
                    "@odata.id": sysp,
                    "UUID": SYSTEM_UUID,
                    "SerialNumber": "SN-1",
                    "PowerState": self.power,
                    "Actions": {
                        "#ComputerSystem.Reset": {
                            "target": f"{sysp}/Actions/ComputerSystem.Reset",
                            "ResetType@Redfish.AllowableValues": list(self.reset_types),
                        }
                    },
                }
            )

        async def reset(request: web.Request) -> web.Response:
            if not authed(request):
                return web.Response(status=401)
            kind = (await request.json())["ResetType"]
            self.resets.append(kind)
            self._polls = 0
            return web.Response(status=202, headers={"Location": "/redfish/v1/TaskService/Tasks/7"})

        async def task(request: web.Request) -> web.Response:
            if not authed(request):
                return web.Response(status=401)
            self._polls += 1
            if self._polls < self.task_polls:
                return web.json_response({"TaskState": "Running"}, status=202)
            self.power = "On"
            return web.json_response({"TaskState": "Completed"})

        app = web.Application()
        app.router.add_get("/redfish/v1/", root)
        app.router.add_post("/redfish/v1/SessionService/Sessions", login)
        app.router.add_delete("/redfish/v1/SessionService/Sessions/{n}", logout)
        app.router.add_get("/redfish/v1/Systems", systems)
        app.router.add_get(sysp, system)
        app.router.add_post(f"{sysp}/Actions/ComputerSystem.Reset", reset)
        app.router.add_get("/redfish/v1/TaskService/Tasks/7", task)
        return app


@dataclass
class LabRedfish:
    """The lab's own Redfish BMC (vm-lab/vmlab/redfish.py) in front of a real, bare QEMU
    machine (no disk, no NIC: nothing leaves it), served on loopback."""

    port: int
    system_id: str
    username: str
    password: str
    app: Any


async def qmp_control(qmp: Path, proc: subprocess.Popen[bytes]) -> Any:
    """The lab's QMP machine control, connected to a QEMU started with ``-qmp unix:<qmp>``
    (the socket file appears at bind, before QEMU listens on it: retried up to 15 s)."""
    from vmlab.power import MachineControl

    end = time.monotonic() + 15
    while True:
        control = MachineControl(str(qmp))
        try:
            await control.connect()
            return control
        except OSError:
            await control.close()
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("QEMU did not open its QMP socket") from None
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def start_lab_redfish(tmp_path: Path, index: int = 0) -> AsyncIterator[LabRedfish]:
    """One lab Redfish BMC in front of its own bare QEMU (``index``: several side by side)."""
    from aiohttp import web

    from vmlab import redfish as lab_redfish_app

    qmp = tmp_path / f"qmp{index}.sock"
    proc = subprocess.Popen(
        ["qemu-system-x86_64", "-accel", "tcg", "-S", "-nodefaults", "-display", "none",
         "-m", "64", "-qmp", f"unix:{qmp},server=on,wait=off"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        control = await qmp_control(qmp, proc)
        info = lab_redfish_app.SystemInfo(
            system_id=f"m{index}", uuid=str(uuid.uuid4()), mac=f"52:54:00:aa:bc:{index + 2:02x}",
            firmware="uefi", memory_mb=64, cpus=1, serial_number=f"LAB-{index + 1:04d}",
            username="admin", password=PASSWORD,
        )  # fmt: skip
        app = lab_redfish_app.make_app(control, info)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port(socket.SOCK_STREAM)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield LabRedfish(port, f"m{index}", "admin", PASSWORD, app)
        finally:
            await runner.cleanup()
            await control.close()
    finally:
        _stop(proc)


@pytest.fixture
async def lab_redfish(tmp_path: Path) -> Any:
    from aiohttp import web

    from vmlab import redfish as lab_redfish_app

    qmp = tmp_path / "qmp.sock"
    proc = subprocess.Popen(
        ["qemu-system-x86_64", "-accel", "tcg", "-S", "-nodefaults", "-display", "none",
         "-m", "64", "-qmp", f"unix:{qmp},server=on,wait=off"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        control = await qmp_control(qmp, proc)
        info = lab_redfish_app.SystemInfo(
            system_id="m0", uuid=str(uuid.uuid4()), mac="52:54:00:aa:bb:02", firmware="uefi",
            memory_mb=64, cpus=1, serial_number="LAB-0001", username="admin", password=PASSWORD,
        )  # fmt: skip
        app = lab_redfish_app.make_app(control, info)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port(socket.SOCK_STREAM)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield LabRedfish(port, "m0", "admin", PASSWORD, app)
        finally:
            await runner.cleanup()
            await control.close()
    finally:
        _stop(proc)
