"""metald inside a vm-lab virtual rack: used by ``make demo`` and the lab end-to-end tests.

Builds the boot assets (cached), brings up a lab, writes a metald config for the lab network,
starts ``metald serve`` inside the lab's namespace, and drives it with ``metalctl`` run inside
the namespace too (the API listens on the lab's boot address, which only the lab can reach).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metald.tenants.runtime import clear_leftovers

BIN = Path(sys.executable).parent


# A tiny, real disk image for claims in the lab: an MBR whose boot code prints MARKER through
# the BIOS (SeaBIOS mirrors it to the serial port) and an ext4 partition with /etc/cloud, where
# the deploy agent puts the cloud-init NoCloud seed. BIOS machines only.
MARKER = b"METALD-TEST-IMAGE BOOTED FROM DISK"
PART_START = 2048  # sectors
PART_BYTES = 8 << 20


def boot_sector(message: bytes) -> bytes:
    """Real-mode code at 0x7c00: print ``message`` with INT 10h teletype, then idle."""
    code = bytearray()
    code += b"\x31\xc0"  # xor ax, ax
    code += b"\x8e\xd8"  # mov ds, ax
    code += b"\x31\xdb"  # xor bx, bx   (page 0)
    si_at = len(code)
    code += b"\xbe\x00\x00"  # mov si, msg  (patched below)
    loop = len(code)
    code += b"\xac"  # lodsb
    code += b"\x08\xc0"  # or al, al
    jz_at = len(code)
    code += b"\x74\x00"  # jz halt (patched)
    code += b"\xb4\x0e"  # mov ah, 0x0e
    code += b"\xcd\x10"  # int 0x10
    code += bytes([0xEB, (loop - (len(code) + 2)) & 0xFF])  # jmp loop
    halt = len(code)
    # sti; hlt: interrupts stay on so SeaBIOS's serial console flushes the last characters.
    code += b"\xfb\xf4"
    code += bytes([0xEB, (halt + 1 - (len(code) + 2)) & 0xFF])  # jmp hlt
    code[jz_at + 1] = halt - (jz_at + 2)
    msg_at = len(code)
    code[si_at + 1 : si_at + 3] = (0x7C00 + msg_at).to_bytes(2, "little")
    code += b"\r\n" + message + b"\r\n\x00"
    assert len(code) <= 446
    return bytes(code)


def build_test_image(workdir: Path) -> tuple[Path, str]:
    root = workdir / "imgroot"
    (root / "etc" / "cloud").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("unconfigured\n")
    part = workdir / "part.ext4"
    with open(part, "wb") as f:
        f.truncate(PART_BYTES)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(root), str(part)], check=True)
    mbr = bytearray(512)
    code = boot_sector(MARKER)
    mbr[: len(code)] = code
    entry = bytearray(16)
    entry[4] = 0x83  # Linux
    entry[8:12] = PART_START.to_bytes(4, "little")
    entry[12:16] = (PART_BYTES // 512).to_bytes(4, "little")
    mbr[446:462] = entry
    mbr[510:512] = b"\x55\xaa"
    image = workdir / "test-image.raw"
    with open(image, "wb") as f:
        f.write(mbr)
        f.write(b"\0" * (PART_START * 512 - 512))
        f.write(part.read_bytes())
    return image, hashlib.sha256(image.read_bytes()).hexdigest()


def curl_json(
    ns: str, method: str, url: str, body: Any = None, token: str | None = None
) -> tuple[int, Any]:
    """One HTTP call with curl from inside namespace ``ns`` (the lab's, or one attached to it,
    as a node would make it); returns (status, JSON body or None)."""
    argv = ["nsenter", f"--net=/run/netns/{ns}", "curl", "-sS", "-m", "60", "-X", method,
            "-w", "\n%{http_code}"]  # fmt: skip
    if token:
        argv += ["-H", f"Authorization: Bearer {token}"]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    r = subprocess.run(
        [*argv, url],
        input=json.dumps(body) if body is not None else None,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        raise RuntimeError(f"curl {method} {url} failed: {r.stderr.strip()}")
    text, _, status = r.stdout.rpartition("\n")
    return int(status), (json.loads(text) if text.strip() else None)


def tenants_config(state: dict[str, Any]) -> str:
    """metald's [tenants] section for a lab: hubs on the lab bridge at 10.k.0.249-254 (the top
    of the range vm-lab leaves to attached namespaces), with Slurm control planes."""
    return (
        "[tenants]\nhubs = true\ncontrol_planes = true\nobserve_interval_s = 1\n"
        f'underlay_bridge = "{state["bridge"]}"\nhub_addresses = "10.{state["slot"]}.0.248/29"\n'
    )


def arm64_assets(amd64: Path, into: Path) -> Path:
    """An assets folder for a lab with arm64 machines: ``amd64``'s files, the lab's iPXE build
    (its arm64 binary: Debian ships none) in ipxe/, and the arm64 image in arm64/ (each built
    on first use, then cached)."""
    from bootassets.build import ensure_built, install_arch

    from .labipxe import assets_with_built_ipxe

    assets = assets_with_built_ipxe(amd64, into)
    install_arch(ensure_built(arch="arm64"), assets)
    return assets


class LabRack:
    def __init__(
        self,
        name: str,
        workdir: Path,
        *,
        machines: int = 3,
        uefi: int = 1,
        extra_config: str | Callable[[dict[str, Any]], str] = "",
        boot_config: str = "",
        nic_rom: bool = True,
        rng: bool = False,
        arm64: int = 0,
        assets: Path | None = None,
        tpm: bool = False,
        secure_boot: bool = False,
        bmc_config: str = "",
        nics: int = 1,
        disks: int = 1,
    ) -> None:
        """``nics``, ``disks``: per machine (``vmlab.lab.Lab``); ``extra_config``: TOML appended to metald's config, or a function of the lab's state
        (slot, bridge, subnet) returning it; ``boot_config``: lines added to its [boot] table;
        ``bmc_config``: lines added to its [bmc] table (e.g. ``secure_boot_cert``);
        ``assets``: the boot assets folder (default: the discovery image's build, cached).
        ``arm64``: the last this many UEFI machines are arm64 (``vmlab.lab.Lab``); metald's
        assets folder then also holds the arm64 image (under arm64/) and the lab's own iPXE
        build (Debian has no arm64 iPXE)."""
        from bootassets.build import ensure_built

        from .lab import Lab

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.assets = assets or ensure_built()
        if arm64:
            self.assets = arm64_assets(self.assets, self.workdir / "assets")
        self._boot_config = boot_config
        self._bmc_config = bmc_config
        self.lab = Lab(
            name, machines=machines, uefi=uefi, workdir=self.workdir / "lab", nic_rom=nic_rom,
            rng=rng, arm64=arm64, tpm=tpm, secure_boot=secure_boot, nics=nics, disks=disks,
        )  # fmt: skip
        try:
            self.state: dict[str, Any] = self.lab.up()
            self._extra_config = (
                extra_config(self.state) if callable(extra_config) else extra_config
            )
            self._start_metald(self._extra_config)
        except BaseException:
            self.lab.down(keep_logs=True)
            raise

    @property
    def machines(self) -> list[dict[str, Any]]:
        return self.state["machines"]

    def _start_metald(self, extra_config: str) -> None:
        st = self.state
        addr, bridge = st["boot_address"], st["bridge"]
        lo, hi = st["dhcp_range"]
        self.url = f"http://{addr}:8080"
        self.state_dir = self.workdir / "metald"
        self.log = self.workdir / "metald.log"
        conf = self.workdir / "metald.toml"
        conf.write_text(
            f'state_dir = "{self.state_dir}"\ninstance = "{self.lab.name}"\n'
            f'[api]\nlisten = "{addr}:8080"\n'
            "[bmc]\npower_sync_interval_s = 0\nmin_interval_ms = 0\n"
            'networks = ["127.0.0.0/8", "0.0.0.0/0", "::/0"]\n'
            f"{self._bmc_config}"
            f'[boot]\nenabled = true\ninterfaces = ["{bridge}"]\nserver_address = "{addr}"\n'
            f'assets_dir = "{self.assets}"\nrouter_advertisements = true\n{self._boot_config}'
            f'[[boot.networks]]\nname = "lab"\nsubnet = "{st["subnet"]}"\npool_start = "{lo}"\n'
            f'pool_end = "{hi}"\ninterface = "{bridge}"\nlease_seconds = 600\n' + extra_config
        )
        # The whole configuration is the file: metald reads METALD_* variables as settings (and
        # refuses unknown ones, such as the test switch METALD_LAB_LONG).
        env = {k: v for k, v in os.environ.items() if not k.startswith("METALD_")}
        self.metald = self.lab.spawn(
            [str(BIN / "metald"), "serve", "--config", str(conf)],
            role="metald",
            log=self.log,
            env=env,
        )
        deadline = time.monotonic() + 60
        while (
            not (self.state_dir / "admin.token").exists() or self.ctl("whoami", check=False)[0] != 0
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("metald did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.3)

    def restart_metald(self, *, crash: bool = True) -> None:
        """Stop metald (SIGKILL when ``crash``, else SIGTERM) and start it again on the same
        state directory and configuration."""
        self.metald.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
        self.metald.wait(30)
        self._start_metald(self._extra_config)

    @property
    def token(self) -> str:
        return (self.state_dir / "admin.token").read_text().strip()

    def ctl(
        self, *args: str, check: bool = True, env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """Run metalctl inside the lab; returns (exit status, stdout)."""
        token = self.token if (self.state_dir / "admin.token").exists() else ""
        full = {**os.environ, "METALD_URL": self.url, "METALD_TOKEN": token, **(env or {})}
        r = self.lab.run(
            [str(BIN / "metalctl"), *args], capture_output=True, text=True, env=full, timeout=120
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"metalctl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}"
            )
        return r.returncode, r.stdout

    def api(
        self, method: str, path: str, body: Any = None, *, token: str | None = None
    ) -> tuple[int, Any]:
        """One HTTP call to metald's API from inside the lab (curl); returns (status, JSON)."""
        return curl_json(self.lab.netns, method, self.url + path, body, token or self.token)

    def json(self, *args: str, env: dict[str, str] | None = None) -> Any:
        return json.loads(self.ctl("--json", *args, env=env)[1])

    def register_bmcs(self, protocols: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Register every machine's BMC by address only; returns machine name -> BMC."""
        protocols = protocols or ["ipmi", "redfish", "auto"]
        out = {}
        for i, m in enumerate(self.machines):
            b, proto = m["bmc"], protocols[i % len(protocols)]
            # The lab's Redfish service is plain HTTP (metald assumes https for a bare address).
            address = f"http://{b['address']}" if proto == "redfish" else b["address"]
            args = [
                "bmcs",
                "register",
                address,
                "--protocol",
                proto,
                "--username",
                b["username"],
            ]
            if proto == "ipmi":
                args += ["--port", str(b["ipmi_port"])]
            elif proto == "redfish":
                args += ["--port", str(b["redfish_port"])]
            out[m["name"]] = self.json(*args, env={"BMC_PASSWORD": b["password"]})
        return out

    def _serve(self, directory: Path, port: int, role: str) -> str:
        """Serve ``directory`` over HTTP on the lab network (boot address); returns its URL."""
        addr = self.state["boot_address"]
        self.lab.spawn(
            [sys.executable, "-m", "http.server", str(port), "--bind", addr,
             "--directory", str(directory)],
            role=role,
            log=self.workdir / f"{role}.log",
        )  # fmt: skip
        return f"http://{addr}:{port}"

    def publish_test_image(self, workdir: Path) -> list[str]:
        """Build the test disk image, serve it on the lab network (boot address, port 8081),
        and return the ``metalctl images create NAME`` arguments that register it."""
        # Built and served from a folder of its own: the workdir also holds metald's state
        # (admin token, secrets key, database), which must never be on the lab network.
        images = workdir / "images"
        images.mkdir(parents=True, exist_ok=True)
        image, sha = build_test_image(images)
        url = f"{self._serve(images, 8081, 'image-server')}/{image.name}"
        return [
            "--kind",
            "disk",
            "--url",
            url,
            "--sha256",
            sha,
            "--size",
            str(image.stat().st_size),
        ]

    def publish_node_image(self, port: int = 8082, arch: str = "amd64") -> list[str]:
        """Build (or reuse) the tenant node image (of ``arch``), serve it on the lab network,
        and return the ``metalctl images create NAME`` arguments of its stateless form."""
        from bootassets.node import ensure_node_built

        node = ensure_node_built(arch=arch)
        base = self._serve(node, port, f"node-image-server-{arch}")
        return [
            "--kind",
            "stateless",
            "--arch",
            arch,
            "--kernel",
            f"{base}/vmlinuz",
            "--initrd",
            f"{base}/initrd.img",
        ]

    def publish_debian_image(self, port: int = 8083) -> dict[str, Any]:
        """Build (or reuse) the Debian 12 image (systemd, cloud-init; ``bootassets.debian``),
        serve its folder on the lab network, and return the ``POST /api/v1/images`` body."""
        from bootassets.debian import ensure_debian_built, image_spec

        built = ensure_debian_built()
        base = self._serve(built, port, "debian-image-server")
        return image_spec(built, f"{base}/disk.raw")

    def machine_by_mac(self, mac: str) -> dict[str, Any] | None:
        for item in self.json("machines", "list", "--limit", "1000")["items"]:
            if any(n["mac"] == mac for n in item["nics"]):
                return item
        return None

    def wait_state(self, macs: list[str], state: str, timeout: float) -> dict[str, float]:
        """Wait until every MAC's machine is in ``state``; returns monotonic arrival times."""
        arrived: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(arrived) < len(macs):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(arrived)} of {len(macs)} machines reached {state}\n{self.diagnostics()}"
                )
            for item in self.json("machines", "list", "--state", state, "--limit", "1000")["items"]:
                for nic in item["nics"]:
                    if nic["mac"] in macs and nic["mac"] not in arrived:
                        arrived[nic["mac"]] = time.monotonic()
            time.sleep(1)
        return arrived

    def diagnostics(self) -> str:
        parts = []
        for m in self.machines:
            log = Path(m["serial_log"])
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
            parts.append(f"--- {m['name']} ({m['firmware']}) serial\n{tail}")
        parts.append("--- metald\n" + (self.log.read_text()[-3000:] if self.log.exists() else ""))
        return "\n".join(parts)

    def down(self) -> None:
        # metald is stopped with the lab's processes; a killed or failed metald leaves its
        # tenant hubs (namespaces, wireguard-go, slurmctld) behind, which the lab does not own.
        self.lab.down(keep_logs=True)
        state_dir = getattr(self, "state_dir", None)
        if state_dir is not None:
            clear_leftovers(state_dir)
