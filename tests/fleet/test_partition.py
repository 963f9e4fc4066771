"""Cut one instance off from PostgreSQL with nftables: it fences itself (no DHCP answer, no BMC
packet) before its share moves, the others take its BMCs and DHCP clients, and when the cut
heals it comes back without a conflicting write.

Real parts: PostgreSQL (Debian's binaries) listening on a bridge; three metald processes, each
in its own network namespace on that bridge, serving DHCP on it; OpenIPMI ``ipmi_sim`` BMCs on
the bridge; a DHCP client in a fourth namespace (``tests/fleet/dhcp_probe.py``). The cut drops
(not rejects) the victim's packets to and from PostgreSQL's port, so its connections hang as on
a real partition. nftables counters in the victim's namespace count what it sends to the BMCs
and how many DHCP answers it sends.

A second test checks the same guard in process: an ownership check whose answer arrives after
the lease ran out (a reply retransmitted after a cut heals) sends nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from metald.bmc import ownership
from metald.bmc.base import PowerAction
from metald.bmc.control import NotOwner
from metald.bmc.service import BmcService
from metald.fleet.rendezvous import owner
from metald.store import Store
from tests.bmc.peers import IpmiSim, ipmi_sim, start_ipmi_sim, stop_peer  # noqa: F401
from tests.conftest import LAB_BMC_TOML
from tests.fleet.test_bmc_ownership import View, _instance, _registered, _sets, svc  # noqa: F401
from tests.test_daemon import BIN, share_secrets_key
from tests.waiting import wait_for
from vmlab.pg import PgServer, pg_bindir

#: Fleet timings: short for the suite. METALD_TEST_FLEET_TIMINGS="2,10" measures the defaults.
HEARTBEAT_S, DEAD_AFTER_S = (
    float(x) for x in os.environ.get("METALD_TEST_FLEET_TIMINGS", "0.5,3").split(",")
)
FENCE_AFTER_S = DEAD_AFTER_S - HEARTBEAT_S
BMC_TIMEOUT_S, BMC_RETRIES = 1.0, 1
#: The longest a BMC operation started before the fencing deadline can keep sending.
BMC_OP_S = BMC_TIMEOUT_S * (BMC_RETRIES + 1)
PID = os.getpid()
NET = IPv4Network(f"10.213.{PID % 250}.0/24")
HOST, CLIENT = NET[1], NET[2]
NAMES = ["rack0", "rack1", "rack2"]
INST = {n: NET[10 + i] for i, n in enumerate(NAMES)}
API_PORT = 8080
MACS = [f"52:54:00:5c:{PID % 256:02x}:{i:02x}" for i in range(24)]


def sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def ns(name: str) -> str:
    return f"mdc{PID}{name[-1] if name != 'client' else 'c'}"


@contextmanager
def segment() -> Iterator[None]:
    """A bridge with PostgreSQL's address, and one namespace per instance plus the client's."""
    br = f"mcb{PID}"[:15]
    made: list[str] = []
    try:
        sh("ip", "link", "add", br, "type", "bridge")
        sh("ip", "addr", "add", f"{HOST}/{NET.prefixlen}", "dev", br)
        sh("ip", "link", "set", br, "up")
        for i, (name, ip) in enumerate([*INST.items(), ("client", CLIENT)]):
            n, hv = ns(name), f"mcv{PID}{i}"[:15]
            sh("ip", "netns", "add", n)
            made.append(n)
            sh("ip", "link", "add", hv, "type", "veth", "peer", "name", "eth0", "netns", n)
            sh("ip", "link", "set", hv, "master", br, "up")
            sh("ip", "-n", n, "addr", "add", f"{ip}/{NET.prefixlen}", "dev", "eth0")
            sh("ip", "-n", n, "link", "set", "eth0", "up")
            sh("ip", "-n", n, "link", "set", "lo", "up")
        yield
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        subprocess.run(["ip", "link", "del", br], capture_output=True)


def pg_on_bridge(server: PgServer) -> None:
    """Restart a private PostgreSQL listening on the bridge too (trusting that subnet)."""
    with open(server.data / "pg_hba.conf", "a") as f:
        f.write(f"host all all {NET} trust\n")
    server._run(["pg_ctl", "-D", str(server.data), "-m", "fast", "-w", "stop"])
    opts = (
        f"-c listen_addresses=127.0.0.1,{HOST} -p {server.port} -k {server.dir} "
        "-c fsync=off -c max_connections=200"
    )
    server._run(
        ["pg_ctl", "-D", str(server.data), "-o", opts, "-l", str(server.dir / "log"), "-w", "start"]
    )


def _conf(tmp: Path, name: str, url: str) -> Path:
    conf = tmp / f"{name}.toml"
    ip = INST[name]
    conf.write_text(
        f'state_dir = "{tmp / name}"\ninstance = "{name}"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "{ip}:{API_PORT}"\npublic_url = "http://{ip}:{API_PORT}"\n'
        f"[fleet]\nheartbeat_s = {HEARTBEAT_S}\ndead_after_s = {DEAD_AFTER_S}\n"
        "[bmc]\n" + LAB_BMC_TOML + "power_sync_interval_s = 0.5\nmin_interval_ms = 0\n"
        f"timeout_s = {BMC_TIMEOUT_S}\nretries = {BMC_RETRIES}\n"
        "[provision]\nwatchdog_interval_s = 1\n"
        f'[boot]\nenabled = true\ninterfaces = ["eth0"]\nserver_address = "{ip}"\n'
        f'assets_dir = "{tmp / "assets"}"\nrouter_advertisements = false\n'
        f'[[boot.networks]]\nname = "prov"\nsubnet = "{NET}"\npool_start = "{NET[100]}"\n'
        f'pool_end = "{NET[200]}"\ninterface = "eth0"\nlease_seconds = 600\n'
    )
    return conf


def _http(name: str, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://{INST[name]}:{API_PORT}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Probe:
    """The DHCP client in its namespace (tests/fleet/dhcp_probe.py)."""

    def __init__(self, log: Path) -> None:
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns("client"),
                sys.executable,
                "-m",
                "tests.fleet.dhcp_probe",
                "eth0",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 - closed with the process
            text=True,
            cwd=root,
        )
        assert json.loads(self.proc.stdout.readline())["ready"]  # type: ignore[union-attr]

    def ask(self, **req: Any) -> list[dict[str, Any]]:
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def answered_by(self, mac: str, window: float = 0.4) -> list[str]:
        return [a["server"] for a in self.ask(op="discover", mac=mac, window=window)]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=10)


def _nft(name: str, script: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns(name), "nft", "-f", "-"], input=script, text=True, check=True
    )


def _counter(name: str, counter: str) -> int:
    out = sh(
        "ip", "netns", "exec", ns(name), "nft", "-j", "list", "counter", "inet", "mdc", counter
    )
    for item in json.loads(out)["nftables"]:
        if "counter" in item:
            return int(item["counter"]["packets"])
    raise AssertionError(out)


def _bmc_rows(store: Store) -> dict[str, tuple[str | None, int]]:
    with store.session() as s:
        rows = s.execute(text("SELECT id, owner, generation FROM bmcs")).all()
    return {r[0]: (r[1], r[2]) for r in rows}


def _heartbeat_age(store: Store, name: str) -> float:
    with store.session() as s:
        return float(
            s.execute(
                text(
                    "SELECT EXTRACT(EPOCH FROM statement_timestamp() - heartbeat_at) "
                    "FROM instances WHERE name = :n"
                ),
                {"n": name},
            ).scalar_one()
        )


@pytest.mark.postgres
@pytest.mark.root
@pytest.mark.skipif(shutil.which("ipmi_sim") is None, reason="ipmi_sim (openipmi) not installed")
@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) not installed")
def test_cut_from_postgresql_fences_then_survivors_take_over_then_it_rejoins(
    tmp_path: Path,
) -> None:
    if pg_bindir() is None:
        pytest.fail("PostgreSQL is not installed; run scripts/bootstrap")
    pg = PgServer()
    procs: dict[str, subprocess.Popen] = {}
    peers: list[subprocess.Popen] = []
    probe: Probe | None = None
    store: Store | None = None
    try:
        with segment():
            pg_on_bridge(pg)
            local = pg.new_database()
            url = local.replace("127.0.0.1", str(HOST))
            (tmp_path / "assets").mkdir()
            share_secrets_key(tmp_path, NAMES)
            for n in NAMES:
                procs[n] = subprocess.Popen(
                    ["ip", "netns", "exec", ns(n), BIN / "metald", "serve", "--config"]
                    + [_conf(tmp_path, n, url)],
                    stderr=open(tmp_path / f"{n}.log", "w"),  # noqa: SIM115
                    # metald reads METALD_* as configuration: not the test's own setting.
                    env={k: v for k, v in os.environ.items() if k != "METALD_TEST_FLEET_TIMINGS"},
                )
            store = Store(local)

            def up(n: str) -> bool:
                assert procs[n].poll() is None, (tmp_path / f"{n}.log").read_text()[-3000:]
                try:
                    urllib.request.urlopen(f"http://{INST[n]}:{API_PORT}/healthz", timeout=1)
                    return True
                except (OSError, urllib.error.URLError):
                    return False

            wait_for("every instance serves", lambda: all(up(n) for n in NAMES))
            admin = next(
                (tmp_path / n / "admin.token").read_text().strip()
                for n in NAMES
                if (tmp_path / n / "admin.token").exists()
            )

            sims: list[IpmiSim] = []
            for i in range(6):
                sim, proc = start_ipmi_sim(tmp_path / f"bmc{i}", power_on=True, addr=str(HOST))
                peers.append(proc)
                sims.append(sim)
            bmc_of: dict[str, IpmiSim] = {}
            for sim in sims:
                code, b = _http(
                    "rack0",
                    "POST",
                    "/api/v1/bmcs",
                    admin,
                    {
                        "address": str(HOST),
                        "port": sim.port,
                        "protocol": "ipmi",
                        "username": sim.username,
                        "password": sim.password,
                    },
                )
                assert code == 201, b
                bmc_of[b["id"]] = sim
            # Counters in every instance's namespace: packets to the BMCs, DHCP answers.
            ports = ", ".join(str(s.port) for s in sims)
            for n in NAMES:
                _nft(
                    n,
                    "table inet mdc {\n counter bmc {}\n counter dhcp {}\n"
                    " chain out { type filter hook output priority 0; policy accept;\n"
                    f"  ip daddr {HOST} udp dport {{ {ports} }} counter name bmc\n"
                    "  udp sport 67 counter name dhcp\n }\n}\n",
                )

            def settled() -> dict[str, tuple[str | None, int]] | None:
                rows = _bmc_rows(store)  # type: ignore[arg-type]
                want = {b: owner(f"bmc:{b}", NAMES) for b in rows}
                return rows if all(rows[b][0] == want[b] for b in rows) else None

            before = wait_for("every BMC held by its owner among all three", settled)
            victim = before[next(iter(bmc_of))][0]
            assert victim is not None
            survivors = [n for n in NAMES if n != victim]
            victims_bmcs = [b for b, (o, _) in before.items() if o == victim]

            probe = Probe(tmp_path / "probe.log")

            def each_answered_once() -> dict[str, list[str]] | None:
                got = {m: probe.answered_by(m) for m in MACS}  # type: ignore[union-attr]
                return got if all(len(a) == 1 for a in got.values()) else None

            # One answer per client, once every instance's split includes the others.
            answered = wait_for("every client answered by exactly one instance", each_answered_once)
            servers = {str(ip): n for n, ip in INST.items()}
            clients = {m: servers[a[0]] for m, a in answered.items()}
            victim_macs = [m for m, n in clients.items() if n == victim]
            assert victim_macs, clients
            # One of the victim's clients binds an address before the cut.
            mac = victim_macs[0]
            offer = probe.ask(op="discover", mac=mac, window=0.5)[0]
            ack = probe.ask(op="request", mac=mac, ip=offer["yiaddr"], server=offer["server"])
            assert [a["type"] for a in ack] == ["ack"], ack
            bound_ip = ack[0]["yiaddr"]

            # The cut: the victim's packets to and from PostgreSQL's port are dropped.
            _nft(
                victim,
                "table inet cut {\n"
                " chain out { type filter hook output priority -10; policy accept;\n"
                f"  ip daddr {HOST} tcp dport {pg.port} drop\n }}\n"
                " chain in { type filter hook input priority -10; policy accept;\n"
                f"  ip saddr {HOST} tcp sport {pg.port} drop\n }}\n}}\n",
            )
            cut = time.monotonic()

            # The fencing deadline, by the database's clock: the victim's last heartbeat plus its
            # fencing age (a small margin for a BMC read already on the wire then).
            wait_for(
                "the victim's heartbeat is past its fencing age",
                lambda: _heartbeat_age(store, victim) > FENCE_AFTER_S + 0.3,  # type: ignore[arg-type]
            )
            fenced_s = time.monotonic() - cut
            bmc_at_fence = _counter(victim, "bmc")
            dhcp_at_fence = _counter(victim, "dhcp")

            def dhcp_taken() -> bool:
                sent = time.monotonic()
                got = probe.answered_by(victim_macs[-1], window=0.3)  # type: ignore[union-attr]
                # Its last heartbeat was before the cut: past cut + fencing age it answers nothing.
                assert str(INST[victim]) not in got or sent - cut < FENCE_AFTER_S, got
                return bool(got) and all(servers[s] in survivors for s in got)

            wait_for("a survivor answers the victim's client", dhcp_taken, timeout=30)
            dhcp_s = time.monotonic() - cut

            def bmcs_taken() -> bool:
                rows = _bmc_rows(store)  # type: ignore[arg-type]
                return all(rows[b][0] in survivors for b in victims_bmcs)

            wait_for("the survivors hold the victim's BMCs", bmcs_taken, timeout=30)
            bmc_s = time.monotonic() - cut
            during = _bmc_rows(store)
            assert all(during[b][1] > before[b][1] for b in victims_bmcs)
            # No BMC operation starts after the fencing deadline; one already in flight then may
            # still retransmit for its timeout (docs/fleet.md, Self-fencing): after that, and
            # after the takeover, not one packet.
            wait_for(
                "the fencing deadline plus the BMC operation bound has passed",
                lambda: _heartbeat_age(store, victim) > FENCE_AFTER_S + 0.3 + BMC_OP_S,  # type: ignore[arg-type]
            )
            bmc_settled = _counter(victim, "bmc")

            # A technician's command for a moved BMC: through the victim it is refused (fenced,
            # the request would need the store); through a survivor it runs on the new holder.
            moved = victims_bmcs[0]

            def powered_off() -> bool:
                # A survivor whose member list is a heartbeat old may still forward to the
                # victim, which answers 503 (it cannot reach the store): retry, as documented.
                code, body = _http(
                    survivors[0], "POST", f"/api/v1/bmcs/{moved}/power", admin, {"action": "off"}
                )
                assert code in (200, 503), (code, body)
                return code == 200

            wait_for("a technician's power-off through a survivor runs", powered_off, timeout=60)
            # The survivors read every moved BMC again; the victim sent nothing meanwhile.
            seen = {b: len(bmc_of[b].calls()) for b in victims_bmcs}
            wait_for(
                "the new holders poll the moved BMCs",
                lambda: all(len(bmc_of[b].calls()) > seen[b] + 1 for b in victims_bmcs),
                timeout=30,
            )

            # Every client is still answered, by one instance; the bound one renews its address
            # at a survivor.
            def survivors_answer_all() -> bool:
                got = {m: probe.answered_by(m) for m in MACS}  # type: ignore[union-attr]
                wrong = {m: a for m, a in got.items() if any(servers[x] == victim for x in a)}
                twice = {m: a for m, a in got.items() if len(a) > 1}
                assert not wrong and not twice, (wrong, twice)  # never the victim, never two
                return all(got.values())  # a slow answer (past the probe's window): ask again

            wait_for("the survivors answer every client", survivors_answer_all, timeout=30)
            renew = probe.ask(op="request", mac=mac, ip=bound_ip, server=None)
            assert [(a["type"], a["yiaddr"]) for a in renew] == [("ack", bound_ip)], renew
            assert _counter(victim, "dhcp") == dhcp_at_fence, "the fenced victim answered DHCP"
            late_bmc = bmc_settled - bmc_at_fence
            assert _counter(victim, "bmc") == bmc_settled, "the fenced victim sent to a BMC"
            vlog = (tmp_path / f"{victim}.log").read_text()
            assert "fenced: no heartbeat written" in vlog, vlog[-3000:]

            # Heal: the victim writes its heartbeat again and takes its share back.
            _nft(victim, "delete table inet cut\n")
            healed = time.monotonic()
            wait_for(
                "the victim holds its BMCs again",
                lambda: all(_bmc_rows(store)[b][0] == victim for b in victims_bmcs),  # type: ignore[arg-type]
                timeout=60,
            )
            back_s = time.monotonic() - healed
            wait_for(
                "the victim answers its clients again",
                lambda: probe.answered_by(victim_macs[-1]) == [str(INST[victim])],  # type: ignore[union-attr]
                timeout=30,
            )
            after = _bmc_rows(store)
            wait_for("every client answered by exactly one instance again", each_answered_once)
            renew = probe.ask(op="request", mac=mac, ip=bound_ip, server=None)
            assert [(a["type"], a["yiaddr"]) for a in renew] == [("ack", bound_ip)], renew

        # No conflicting write: generations only grew, each BMC got the one command once, no
        # client holds two addresses.
        for b in victims_bmcs:
            assert before[b][1] < during[b][1] < after[b][1], (before[b], during[b], after[b])
        sets = {b: [c for c in sim.calls() if c.startswith("set ")] for b, sim in bmc_of.items()}
        assert sets[moved] == ["set power 0"], sets
        assert all(not v for b, v in sets.items() if b != moved), sets
        with store.session() as s:
            dup = s.execute(
                text(
                    "SELECT mac, count(*) FROM leases WHERE state IN ('bound', 'offered') "
                    "AND expires_at > now() GROUP BY mac HAVING count(*) > 1"
                )
            ).all()
            assert dup == [], dup
        print(
            f"\npartition: {victim} cut from PostgreSQL; fencing deadline {fenced_s:.2f} s after "
            f"the cut; its DHCP client answered by a survivor after {dhcp_s:.2f} s; its "
            f"{len(victims_bmcs)} BMCs held by survivors after {bmc_s:.2f} s; back to it "
            f"{back_s:.2f} s after the heal (heartbeat_s {HEARTBEAT_S}, dead_after_s "
            f"{DEAD_AFTER_S}); BMC packets of operations in flight at the fencing deadline: "
            f"{late_bmc}"
        )
    finally:
        if probe is not None:
            probe.close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in peers:
            stop_peer(p)
        if store is not None:
            store.close()
        pg.stop()


async def test_an_ownership_check_answered_after_the_lease_ran_out_sends_nothing(
    svc: BmcService,  # noqa: F811
    store: Store,
    ipmi_sim: IpmiSim,  # noqa: F811
) -> None:
    """The check before a command passed in the store, but its answer came back after this
    instance's lease (read before asking) ran out: the others may hold the BMC by now."""
    _instance(store, "a")
    mid, _ = await _registered(svc, store, ipmi_sim)

    class Lease(View):
        until = float("inf")

        def lease_until(self) -> float:
            return self.until

    view = Lease("a", owner="a")
    svc.ownership = view
    real_run = store.run

    async def late(fn: Any, *args: Any, **kwargs: Any) -> Any:
        got = await real_run(fn, *args, **kwargs)
        if fn is ownership.check_and_journal:
            # The lease held when asking runs out while the answer is on its way back (a cut
            # link), then the heartbeat is written again (the cut healed): the old answer
            # still counts for nothing.
            while time.monotonic() <= view.until:
                await asyncio.sleep(0.01)
            view.until = float("inf")
        return got

    store.run = late  # type: ignore[method-assign]
    view.until = time.monotonic() + 0.2
    with pytest.raises(NotOwner, match="fenced itself"):
        await svc.control.power(mid, PowerAction.ON)
    assert _sets(ipmi_sim) == []
    store.run = real_run  # type: ignore[method-assign]
    assert await svc.control.power(mid, PowerAction.ON) == "on"  # in time: sent
    assert _sets(ipmi_sim) == ["set power 1"]
