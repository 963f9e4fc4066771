"""The DHCP server's asyncio shell: sockets in, handler decisions out.

One socket per configured interface (SO_BINDTODEVICE), so metald never answers on a network it
was not given. Reads are drained in a loop per wake-up, and while packets keep coming a socket
is polled every commit interval instead of waking the loop per datagram (``_drain``); an ACK is
sent from the lease store's commit callback, so it leaves only after its lease is durable. Nothing a client sends can raise
out of here: malformed packets are counted by reason and dropped.

The full-mode core decides from the in-memory lease table and returns records; this shell
applies them to the table and submits the durable writes. With other instances on the network
(``peers``), it first asks whether this instance answers the client at all (the RFC 3074
split, fencing), and reads a client this table does not know from the store before deciding
(another instance may have leased it: see ``lease_feed``).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

from metald.boot import metrics
from metald.boot.dhcp.bootfile import PLAIN, BootFiles
from metald.boot.dhcp.common import SERVER_PORT, Decision, NetworkPlan, choose_network
from metald.boot.dhcp.enroll_limit import EnrollLimiter, EnrollLimits, keys_for
from metald.boot.dhcp.full import FullHandler
from metald.boot.dhcp.lease_store import COMMIT_INTERVAL, LeaseStore, WriteResult
from metald.boot.dhcp.packet import (
    MAX_PACKET,
    ZERO,
    DhcpPacket,
    MalformedPacket,
    MessageType,
    Opt,
    RelaySub,
    parse,
    serialize,
)
from metald.boot.dhcp.peers import DhcpPeers
from metald.boot.dhcp.proxy import ProxyHandler
from metald.boot.hooks import BootHooks
from metald.boot.netutil import udp_socket

log = logging.getLogger(__name__)

#: A MAC is reported to the hooks again after this long (or when its option 82 changes).
SEEN_TTL_SECONDS = 300.0
#: Most clients remembered for that de-duplication: a flood of made-up MACs must not grow
#: memory without bound (past it the oldest are forgotten: at worst a repeated hook call).
MAX_SEEN = 65536


class RecentClients:
    """MACs reported to the hooks lately, oldest report first (dicts keep insertion order)."""

    def __init__(self, limit: int = MAX_SEEN, ttl_s: float = SEEN_TTL_SECONDS) -> None:
        self.limit, self.ttl_s = limit, ttl_s
        self._seen: dict[str, tuple[float, object]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def due(self, mac: str, relay: object, now: float) -> bool:
        """Whether the hooks should hear of this client again (new, moved, or stale)."""
        prev = self._seen.get(mac)
        return prev is None or prev[1] != relay or now - prev[0] >= self.ttl_s

    def mark(self, mac: str, relay: object, now: float) -> None:
        self._seen.pop(mac, None)  # to the end: the order stays oldest report first
        self._seen[mac] = (now, relay)
        if len(self._seen) > self.limit:
            for old in list(self._seen):
                t = self._seen[old][0]
                if len(self._seen) <= self.limit // 2 and now - t < self.ttl_s:
                    break
                del self._seen[old]

    def forget(self, mac: str) -> None:
        self._seen.pop(mac, None)


#: A client this table did not know is read from the store again after this long at the
#: earliest (the lease feed reports what other instances write meanwhile).
LOOKUP_TTL_SECONDS = 30.0
#: Packets waiting for a read-through at most; beyond it they are dropped (the client retries).
MAX_LOOKUP_BACKLOG = 4096
#: Client messages whose MAC is read through on a miss.
_LOOKED_UP = frozenset(
    (MessageType.DISCOVER, MessageType.REQUEST, MessageType.DECLINE, MessageType.RELEASE)
)

#: Datagrams handled per wake-up at most, so one busy socket cannot starve the loop.
MAX_DRAIN = 256
#: While packets keep arriving, a socket is read this often instead of on every arrival; the
#: lease store's commit interval, so a poll and the commit of its writes share a loop pass.
POLL_INTERVAL = COMMIT_INTERVAL

#: Hook calls in flight at most; beyond it a sighting is skipped (the next DHCP retry reports).
#: Above the enroll limiter's default total burst (2,000): the limiter is what sheds a flood,
#: this only bounds what a stuck store can hold. At 64, a 1,000-machine power-on skipped most
#: sightings (their calls queue on the store's writer), and with ``script_clients = "any"``
#: each such machine was then served its script without a token: a wasted discovery boot.
MAX_HOOK_CALLS = 2048


def _batch_io() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``recv_batch`` and ``send_batch`` of the C extension (``_batchio.c``: recvmmsg and
    sendmmsg, several datagrams per system call), or None where it is not built: then one
    recvfrom or sendto per datagram."""
    try:
        from metald.boot.dhcp._batchio import recv_batch, send_batch
    except ImportError:
        return None
    return recv_batch, send_batch


#: Chosen at import; ``DhcpServer(batch_io=False)`` reads and sends one datagram per call
#: whatever this is.
BATCH_IO = _batch_io()
#: What recv_batch keeps of a datagram: one byte more than ``parse`` accepts, so a longer
#: one is still refused as oversized, as the whole datagram from recvfrom is.
_RECV_SIZE = MAX_PACKET + 1
_SEND_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)

#: Metric labels, computed once instead of ``mtype.name.lower()`` per packet.
_TYPE_LABELS = {t: t.name.lower() for t in MessageType}
_REPLY_LABELS = {bytes((t,)): t.name.lower() for t in MessageType}
_ENROLL_LIMITED = {k: f"enroll-limited-{k}" for k in ("port", "relay", "source", "total")}
#: (counter, label) -> the labelled Prometheus child.
_CHILDREN: dict[tuple[object, str], Any] = {}


@dataclass
class _Listener:
    sock: socket.socket
    interface: str
    proxy_port: bool
    #: The next poll while the socket is polled rather than waited on (see ``_drain``).
    poll: asyncio.Handle | None = None
    #: Read and answered in batches (``BATCH_IO``); else one datagram per call.
    batch: bool = False


def relay_agent_view(pkt: DhcpPacket) -> dict[str, str] | None:
    ra = pkt.relay_agent
    if not ra:
        return None
    out: dict[str, str] = {}
    for key, sub in (("circuit_id", RelaySub.CIRCUIT_ID), ("remote_id", RelaySub.REMOTE_ID)):
        v = ra.get(sub)
        if v is not None:
            out[key] = v.decode() if v.isascii() and v.decode().isprintable() else v.hex()
    return out or None


class DhcpServer:
    name = "dhcp"

    def __init__(
        self,
        *,
        mode: str,
        interfaces: list[str],
        networks: list[NetworkPlan],
        server_id: IPv4Address,
        files: BootFiles,
        leases: LeaseStore | None,
        hooks: BootHooks | None = None,
        port: int = 67,
        proxy_port: int = 4011,
        bind_host: str = "0.0.0.0",
        clock: Callable[[], float] = time.time,
        relay_port: int = SERVER_PORT,
        enroll_limits: EnrollLimits | None = None,
        batch_io: bool = True,
    ) -> None:
        if mode not in ("full", "proxy"):
            raise ValueError(f"DHCP mode {mode!r}")
        if mode == "full" and leases is None:
            raise ValueError("full mode needs a lease store")
        self.mode = mode
        self.interfaces = interfaces
        self.networks = networks
        self.server_id = server_id
        self.leases = leases
        self.hooks = hooks
        self.port = port
        self.proxy_port = proxy_port
        self.bind_host = bind_host
        self.clock = clock
        #: Where replies to relays go; 67 except in tests that cannot hold port 67.
        self.relay_port = relay_port
        self.poll_interval = POLL_INTERVAL
        self.full = FullHandler(server_id, files)
        self.proxy = ProxyHandler(server_id, files)
        self._listeners: list[_Listener] = []
        self._seen = RecentClients()
        #: How fast unreported clients reach the hooks (which enroll unknown MACs).
        self.enroll_limiter = EnrollLimiter(enroll_limits)
        self._hook_tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counts: dict[tuple[object, str], int] = {}
        self._counts_flush_scheduled = False
        #: Set when other instances may serve these networks (plane.py): the split and fencing.
        self.peers: DhcpPeers | None = None
        #: MAC -> when it was last read through from the store.
        self._looked_up: dict[str, float] = {}
        self._lookups: list[tuple[DhcpPacket, NetworkPlan, tuple[str, int], _Listener]] = []
        self._lookup_task: asyncio.Task[None] | None = None
        #: recvmmsg/sendmmsg (``BATCH_IO``), unless not built or turned off (tests, benches).
        self.batch_io = BATCH_IO if batch_io else None
        #: Replies waiting to go out in one sendmmsg per socket, as parallel lists (socket,
        #: bytes, host, port, message type): sent at the end of the wake-up that made them
        #: (``_flush_out``).
        self._out_socks: list[socket.socket] = []
        self._out_data: list[bytes] = []
        self._out_hosts: list[str] = []
        self._out_ports: list[int] = []
        self._out_types: list[bytes | None] = []
        self._out_flush_scheduled = False
        #: The listeners' sockets that send in batches.
        self._batch_socks: set[socket.socket] = set()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Everything alive now (imported modules, config, ORM metadata) lives as long as the
        # process: take it out of the cyclic GC, whose full collections otherwise walk that
        # whole heap again and again under a DHCP storm (~5 us per DORA measured).
        gc.freeze()
        try:
            for iface in self.interfaces:
                self._listen(iface, self.port, proxy_port=False)
                if self.mode == "proxy":
                    self._listen(iface, self.proxy_port, proxy_port=True)
        except BaseException:
            await self.stop()
            raise
        log.info("DHCP (%s) on %s port %d", self.mode, ",".join(self.interfaces), self.port)

    def _listen(self, iface: str, port: int, *, proxy_port: bool) -> None:
        assert self._loop is not None
        sock = udp_socket(self.bind_host, port, interface=iface, broadcast=True)
        batch = self.batch_io is not None and sock.family == socket.AF_INET
        lst = _Listener(sock, iface, proxy_port, batch=batch)
        if batch:
            self._batch_socks.add(sock)
            if self.leases is not None:
                # The ACKs of one commit leave in one sendmmsg, right after it.
                self.leases.after_batch = self._flush_out
        self._listeners.append(lst)
        self._loop.add_reader(sock.fileno(), self._readable, lst)

    async def stop(self) -> None:
        self._flush_out()
        self._flush_counts()
        for lst in self._listeners:
            if lst.poll is not None:
                lst.poll.cancel()
                lst.poll = None
            elif self._loop is not None:
                self._loop.remove_reader(lst.sock.fileno())
            lst.sock.close()
        self._listeners.clear()
        self._batch_socks.clear()
        if self._lookup_task is not None:
            self._lookup_task.cancel()
            await asyncio.gather(self._lookup_task, return_exceptions=True)
        for t in list(self._hook_tasks):
            t.cancel()
        if self._hook_tasks:
            await asyncio.gather(*self._hook_tasks, return_exceptions=True)
        if self.leases is not None:
            await self.leases.drain()

    async def idle(self) -> None:
        """Return once every packet handled so far is answered or dropped: read-throughs
        done, lease writes committed (and their replies sent)."""
        while True:
            if self._lookup_task is not None and not self._lookup_task.done():
                await asyncio.shield(self._lookup_task)
                continue
            if self.leases is not None:
                await self.leases.drain()
            if self._lookup_task is None or self._lookup_task.done():
                self._flush_out()  # replies queued outside a drain or a commit
                return

    # -- receive path -------------------------------------------------------------------

    def _readable(self, lst: _Listener) -> None:
        """The socket became readable: drain it and, if it held packets, poll it from now on
        instead of waiting on it (see ``_drain``)."""
        got = self._drain(lst)
        if got and self.poll_interval > 0 and self._loop is not None:
            self._loop.remove_reader(lst.sock.fileno())
            self._next_poll(lst, got)

    def _poll(self, lst: _Listener) -> None:
        assert self._loop is not None
        got = self._drain(lst)
        if got:
            self._next_poll(lst, got)
        else:  # quiet again: wait on the socket (level-triggered: nothing is missed)
            lst.poll = None
            self._loop.add_reader(lst.sock.fileno(), self._readable, lst)

    def _next_poll(self, lst: _Listener, got: int) -> None:
        assert self._loop is not None
        if got >= MAX_DRAIN:  # more waiting: read on right after the loop's other callbacks
            lst.poll = self._loop.call_soon(self._poll, lst)
        else:
            lst.poll = self._loop.call_later(self.poll_interval, self._poll, lst)

    def _drain(self, lst: _Listener) -> int:
        """Read and handle what the socket holds (at most MAX_DRAIN); return how many.

        Under load, waking once per datagram costs more than handling it (a wake-up, a
        failed recvfrom and a loop pass each), so while packets keep coming the socket is
        polled every ``poll_interval`` and each poll handles what arrived since: one pass
        per poll, not per packet. An idle socket is waited on as before (no added latency
        for the first packet of a burst)."""
        if lst.batch:
            return self._drain_batch(lst)
        recvfrom, handle = lst.sock.recvfrom, self._handle
        self._counts_flush_scheduled = True  # flushed below, at the end of this wake-up
        n = 0
        try:
            while n < MAX_DRAIN:  # bounded, so one busy socket cannot starve the loop
                try:
                    data, src = recvfrom(65535)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    log.warning("DHCP receive on %s: %s", lst.interface, e)
                    break
                n += 1
                handle(data, src, lst)
        finally:
            self._flush_counts()
        return n

    def _drain_batch(self, lst: _Listener) -> int:
        """``_drain`` with recvmmsg: what the socket holds (at most MAX_DRAIN) read in a few
        system calls, each datagram handled exactly as there, in order; the replies made meanwhile
        leave together at the end (sendmmsg)."""
        assert self.batch_io is not None
        handle = self._handle
        self._counts_flush_scheduled = True  # flushed below, at the end of this wake-up
        self._out_flush_scheduled = True  # the same for the replies
        n = 0
        try:
            got, err = self.batch_io[0](lst.sock.fileno(), MAX_DRAIN, _RECV_SIZE)
            for data, src in got:
                n += 1
                handle(data, src, lst)
            if err and err not in _SEND_AGAIN:
                log.warning("DHCP receive on %s: %s", lst.interface, os.strerror(err))
        finally:
            self._flush_out()
            self._flush_counts()
        return n

    def _flush_out(self) -> None:
        """Send the replies queued by ``_send``, in order, one sendmmsg per socket (a run of
        replies for one socket), each counted as ``_send`` counts it."""
        self._out_flush_scheduled = False
        socks = self._out_socks
        if not socks:
            return
        data, hosts, ports, types = (
            self._out_data,
            self._out_hosts,
            self._out_ports,
            self._out_types,
        )
        self._out_socks, self._out_data, self._out_hosts = [], [], []
        self._out_ports, self._out_types = [], []
        if socks.count(socks[0]) == len(socks):  # one listener: the usual case
            self._send_run(socks[0], data, hosts, ports, types)
            return
        i = 0
        while i < len(socks):
            j = i + 1
            while j < len(socks) and socks[j] is socks[i]:
                j += 1
            self._send_run(socks[i], data[i:j], hosts[i:j], ports[i:j], types[i:j])
            i = j

    def _send_run(
        self,
        sock: socket.socket,
        data: list[bytes],
        hosts: list[str],
        ports: list[int],
        types: list[bytes | None],
    ) -> None:
        if sock.fileno() < 0:  # closed meanwhile (stop): as _send, nothing to send on
            return
        assert self.batch_io is not None
        failed = self.batch_io[1](sock.fileno(), data, hosts, ports)
        if failed:
            types = types[:]
            for k, err in reversed(failed):
                del types[k]
                if err in _SEND_AGAIN:
                    self._count(metrics.dhcp_dropped, "send-queue-full")
                else:
                    log.warning(
                        "DHCP send to %s failed: %s", (hosts[k], ports[k]), os.strerror(err)
                    )
                    self._count(metrics.dhcp_dropped, "send-failed")
        counts = self._counts
        for mt, n in Counter(types).items():
            key = (metrics.dhcp_replies, _REPLY_LABELS.get(mt, "bootp") if mt else "bootp")
            counts[key] = counts.get(key, 0) + n
        if not self._counts_flush_scheduled and self._loop is not None:
            self._counts_flush_scheduled = True
            self._loop.call_soon(self._flush_counts)

    # -- counters -----------------------------------------------------------------------
    # Counted in a plain dict per wake-up and added to the Prometheus counters once at its
    # end: a Prometheus inc() (lock, checks) cost more than the rest of a counter's work.

    def _count(self, counter: object, label: str) -> None:
        key = (counter, label)
        self._counts[key] = self._counts.get(key, 0) + 1
        if not self._counts_flush_scheduled and self._loop is not None:
            # Counts made outside a drain (ACKs sent from a commit callback).
            self._counts_flush_scheduled = True
            self._loop.call_soon(self._flush_counts)

    def _flush_counts(self) -> None:
        self._counts_flush_scheduled = False
        if self._counts:
            counts, self._counts = self._counts, {}
            for key, n in counts.items():
                child = _CHILDREN.get(key)
                if child is None:
                    child = _CHILDREN[key] = key[0].labels(key[1])  # type: ignore[attr-defined]
                child.inc(n)

    def handle_datagram(self, data: bytes, src: tuple[str, int], lst: _Listener) -> None:
        """Handle one datagram; its reply (if not waiting for a commit) is sent and counters
        are updated before it returns."""
        try:
            self._handle(data, src, lst)
        finally:
            self._flush_out()
            self._flush_counts()

    def _handle(self, data: bytes, src: tuple[str, int], lst: _Listener) -> None:
        # Counted straight into the wake-up's dict (every caller flushes it when done): the
        # hot path's two counts per packet without a method call each.
        counts = self._counts
        try:
            pkt = parse(data)
            if pkt.op != 1:  # BOOTREQUEST
                self._count(metrics.dhcp_dropped, "not-a-request")
                return
            mtype = pkt.message_type
            if mtype is None:
                self._count(metrics.dhcp_dropped, "no-message-type")
                return
            key = (metrics.dhcp_packets, _TYPE_LABELS[mtype])
            counts[key] = counts.get(key, 0) + 1
            decision = self._decide(pkt, src, lst)
        except MalformedPacket as e:
            self._count(metrics.dhcp_dropped, e.reason)
            return
        except Exception:
            log.exception("DHCP packet from %s crashed the handler; dropped", src)
            self._count(metrics.dhcp_dropped, "handler-error")
            return
        if decision is None:
            return
        # _act, inline for the common case: nothing to report, no extra writes.
        kind = decision.kind
        if (
            decision.extra_writes
            or decision.ignored
            or (kind is not None and kind is not PLAIN and self.hooks is not None and kind.boots)
        ):
            self._act(pkt, decision, src, lst)
        elif decision.write is not None and self.leases is not None:
            self.leases.submit(
                decision.write, lambda res, d=decision, s=lst.sock: self._committed(res, d, s)
            )
        elif decision.reply is not None:
            self._send(lst.sock, decision.reply, decision.dest)

    def _act(
        self, pkt: DhcpPacket, decision: Decision, src: tuple[str, int], lst: _Listener
    ) -> None:
        count = self._count
        if decision.kind is not None and decision.kind.boots and self.hooks is not None:
            self._report(pkt, decision, src, lst.interface)
        if decision.ignored:
            count(metrics.dhcp_ignored, decision.ignored)
        if decision.extra_writes and self.leases is not None:
            for extra in decision.extra_writes:
                self.leases.submit(extra, _ignore_result)
        if decision.write is not None and self.leases is not None:
            self.leases.submit(
                decision.write, lambda res, d=decision, s=lst.sock: self._committed(res, d, s)
            )
        elif decision.reply is not None:
            self._send(lst.sock, decision.reply, decision.dest)

    def _decide(self, pkt: DhcpPacket, src: tuple[str, int], lst: _Listener) -> Decision | None:
        net = choose_network(pkt, lst.interface, self.networks)
        if self.mode == "proxy":
            return self.proxy.handle(pkt, net, src, on_proxy_port=lst.proxy_port)
        if net is None:
            self._count(metrics.dhcp_dropped, "no-network")
            return None
        assert self.leases is not None
        peers = self.peers
        if peers is not None:
            why = peers.refusal(pkt, net.name)
            if why is not None:
                self._count(metrics.dhcp_ignored, why)
                return None
            if self._read_through(pkt, net, src, lst):
                return None
        # _full_decision, inline: this is the hot path.
        table = self.leases.table
        d = self.full.decide(pkt, net, table, self.clock())
        for rec in d.puts:
            table.put(rec)
        return d

    def _full_decision(self, pkt: DhcpPacket, net: NetworkPlan) -> Decision:
        assert self.leases is not None
        table = self.leases.table
        d = self.full.decide(pkt, net, table, self.clock())
        for rec in d.puts:  # LeaseTable.apply, without a call on the hot path
            table.put(rec)
        return d

    # -- read-through (other instances on the network) ------------------------------------

    def _read_through(
        self, pkt: DhcpPacket, net: NetworkPlan, src: tuple[str, int], lst: _Listener
    ) -> bool:
        """Queue ``pkt`` for deciding after its MAC's stored leases were read, when this
        table does not know the client. True when queued."""
        assert self.leases is not None
        if pkt.message_type not in _LOOKED_UP:
            return False
        mac = pkt.mac
        if self.leases.table.for_mac(net.name, mac) is not None:
            return False
        now = self.clock()
        seen = self._looked_up.get(mac)
        if seen is not None and now - seen < LOOKUP_TTL_SECONDS:
            return False
        if len(self._lookups) >= MAX_LOOKUP_BACKLOG or self._loop is None:
            self._count(metrics.dhcp_dropped, "lookup-backlog")
            return True
        self._lookups.append((pkt, net, src, lst))
        if self._lookup_task is None or self._lookup_task.done():
            self._lookup_task = self._loop.create_task(self._look_up(), name="dhcp-read-through")
        return True

    async def _look_up(self) -> None:
        assert self.leases is not None
        while self._lookups:
            batch, self._lookups = self._lookups, []
            by_net: dict[str, tuple[set[str], set[IPv4Address]]] = {}
            for pkt, net, _, _ in batch:
                macs, ips = by_net.setdefault(net.name, (set(), set()))
                macs.add(pkt.mac)
                for ip in (pkt.requested_ip, pkt.ciaddr):
                    if ip is not None and ip != ZERO:
                        ips.add(ip)
            for name, (macs, ips) in by_net.items():
                try:
                    recs = await self.leases.read(name, macs, ips)
                except Exception as e:  # noqa: BLE001 - decide on what this table knows
                    log.warning("reading leases of %d clients failed: %s", len(macs), e)
                    self._count(metrics.dhcp_dropped, "lease-read-failed")
                    continue
                now, learn = self.clock(), self.leases.table.learn
                for rec in recs:
                    learn(rec, now)
            now = self.clock()
            if len(self._looked_up) > 65536:
                self._looked_up.clear()
            for pkt, net, src, lst in batch:
                self._looked_up[pkt.mac] = now
                try:
                    # Judged again: fencing or the split may have changed meanwhile.
                    peers = self.peers
                    why = None if peers is None else peers.refusal(pkt, net.name)
                    if why is not None:
                        self._count(metrics.dhcp_ignored, why)
                        continue
                    self._act(pkt, self._full_decision(pkt, net), src, lst)
                except Exception:
                    log.exception("DHCP packet from %s crashed the handler; dropped", src)
                    self._count(metrics.dhcp_dropped, "handler-error")

    def _committed(self, res: WriteResult, d: Decision, sock: socket.socket) -> None:
        if res is WriteResult.OK:
            if d.reply is not None:
                self._send(sock, d.reply, d.dest)
        elif res is WriteResult.CONFLICT:
            self._count(metrics.dhcp_ignored, "lease-conflict")
            if d.write is not None and self.leases is not None:
                # Another instance holds it: remember that so we do not offer it again.
                self.leases.table.lost(d.write, self.clock() + 60)
            nak = d.on_conflict() if d.on_conflict is not None else None
            if nak is not None:
                self._send(sock, nak, d.dest)
        else:
            self._count(metrics.dhcp_dropped, "lease-write-failed")

    def _send(self, sock: socket.socket, reply: DhcpPacket, dest: tuple[str, int] | None) -> None:
        if dest is None or sock.fileno() < 0:
            return
        if dest[1] == SERVER_PORT and self.relay_port != SERVER_PORT:
            dest = (dest[0], self.relay_port)
        if sock in self._batch_socks:
            # Queued: sent with the wake-up's other replies (_flush_out), counted there.
            self._out_socks.append(sock)
            self._out_data.append(serialize(reply))
            self._out_hosts.append(dest[0])
            self._out_ports.append(dest[1])
            self._out_types.append(reply.options.get(Opt.MESSAGE_TYPE))
            if not self._out_flush_scheduled and self._loop is not None:
                # Queued outside a drain or a commit (a read-through): sent on the next pass.
                self._out_flush_scheduled = True
                self._loop.call_soon(self._flush_out)
            return
        try:
            sock.sendto(serialize(reply), dest)
        except (BlockingIOError, InterruptedError):
            self._count(metrics.dhcp_dropped, "send-queue-full")
            return
        except OSError as e:
            log.warning("DHCP send to %s failed: %s", dest, e)
            self._count(metrics.dhcp_dropped, "send-failed")
            return
        mt = reply.options.get(Opt.MESSAGE_TYPE)
        self._count(metrics.dhcp_replies, _REPLY_LABELS.get(mt, "bootp") if mt else "bootp")

    # -- hooks --------------------------------------------------------------------------

    def _report(self, pkt: DhcpPacket, d: Decision, src: tuple[str, int], interface: str) -> None:
        if pkt.hlen != 6:
            return  # machines are known by 6-byte MACs; anything else cannot be enrolled
        try:
            relay = relay_agent_view(pkt)
        except MalformedPacket:
            relay = None
        now = self.clock()
        if not self._seen.due(pkt.mac, relay, now):
            return
        if len(self._hook_tasks) >= MAX_HOOK_CALLS or self._loop is None:
            self._count(metrics.dhcp_ignored, "hook-backlog")
            return
        refused = self.enroll_limiter.admit(keys_for(pkt, src, interface), now)
        if refused is not None:
            # Not marked as reported: the client's next packet tries again.
            self._count(metrics.dhcp_ignored, _ENROLL_LIMITED[refused])
            return
        self._seen.mark(pkt.mac, relay, now)
        assert self.hooks is not None and d.kind is not None
        task = self._loop.create_task(self._call_hook(pkt.mac, d.kind.arch.value, d.network, relay))
        self._hook_tasks.add(task)
        task.add_done_callback(self._hook_tasks.discard)

    async def _call_hook(
        self, mac: str, arch: str, network: str | None, relay: dict[str, str] | None
    ) -> None:
        assert self.hooks is not None
        try:
            await self.hooks.client_seen(mac, arch=arch, network=network, relay_agent=relay)
        except Exception:
            self._seen.forget(mac)  # try again on the client's next packet
            log.exception("client_seen(%s) failed", mac)


def _ignore_result(_res: WriteResult) -> None:
    pass
