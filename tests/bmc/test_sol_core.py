"""The SOL core with plain bytes and a hand-driven clock: sequence numbers, acks, partial
acceptance, retransmission, duplicates, break, malformed payloads."""

from __future__ import annotations

from metald.bmc import sol
from metald.bmc.sol import SolCore, SolPacket, decode_sol, encode_sol


def _bmc(
    seq: int = 0, ack: int = 0, accepted: int = 0, status: int = 0, data: bytes = b""
) -> bytes:
    return encode_sol(SolPacket(seq, ack, accepted, status, data))


def test_typed_characters_go_out_in_one_numbered_packet() -> None:
    c = SolCore()
    c.write(b"ls\r")
    [out] = c.due(0.0)
    p = decode_sol(out)
    assert (p.seq, p.ack, p.data) == (1, 0, b"ls\r")
    assert c.due(0.1) == []  # stop-and-wait: nothing more until acked or timed out


def test_partially_accepted_data_is_resent_under_the_next_number() -> None:
    c = SolCore()
    c.write(b"abcdef")
    c.due(0.0)
    c.on_payload(_bmc(ack=1, accepted=4), 0.1)
    [out] = c.due(0.1)
    p = decode_sol(out)
    assert (p.seq, p.data) == (2, b"ef")


def test_an_unacknowledged_packet_is_retransmitted_then_the_link_fails() -> None:
    c = SolCore(retransmit_s=1.0, max_tries=3)
    c.write(b"x")
    first = c.due(0.0)
    assert c.due(0.5) == []
    assert c.due(1.0) == first  # same number, same data
    assert c.due(2.0) == first
    assert not c.failed
    assert c.due(3.0) == []
    assert c.failed
    assert c.counters.retransmitted == 2


def test_a_nack_keeps_the_packet_in_flight_without_spending_a_try() -> None:
    c = SolCore(retransmit_s=1.0, max_tries=2)
    c.write(b"x")
    c.due(0.0)
    for t in range(1, 6):
        c.on_payload(_bmc(ack=1, status=sol.ST_NACK), t - 0.5)
        assert c.due(float(t))
    assert not c.failed


def test_bmc_data_is_delivered_once_and_acknowledged_each_time() -> None:
    c = SolCore()
    assert c.on_payload(_bmc(seq=3, data=b"boot"), 0.0) == b"boot"
    [ack] = c.due(0.0)
    assert decode_sol(ack) == SolPacket(0, 3, 4, 0, b"")
    # The ack was lost: the BMC sends the same packet again.
    assert c.on_payload(_bmc(seq=3, data=b"boot"), 1.0) == b""
    [ack] = c.due(1.0)
    assert decode_sol(ack).ack == 3
    assert c.counters.duplicates == 1
    assert c.on_payload(_bmc(seq=4, data=b"ing"), 2.0) == b"ing"


def test_an_ack_rides_on_outgoing_data() -> None:
    c = SolCore()
    c.on_payload(_bmc(seq=7, data=b"login: "), 0.0)
    c.write(b"root\r")
    [out] = c.due(0.0)
    p = decode_sol(out)
    assert (p.seq, p.ack, p.accepted, p.data) == (1, 7, 7, b"root\r")


def test_break_is_an_operation_bit() -> None:
    c = SolCore()
    c.send_break()
    [out] = c.due(0.0)
    p = decode_sol(out)
    assert p.status & sol.OP_BREAK and p.seq == 1 and p.data == b""


def test_sequence_numbers_wrap_from_15_to_1() -> None:
    c = SolCore()
    seqs = []
    for i in range(17):
        c.write(b"k")
        [out] = c.due(float(i))
        seqs.append(decode_sol(out).seq)
        c.on_payload(_bmc(ack=seqs[-1], accepted=1), float(i))
    assert seqs == [*range(1, 16), 1, 2]


def test_malformed_and_stale_payloads_are_counted_and_dropped() -> None:
    c = SolCore()
    assert c.on_payload(b"\x01\x00", 0.0) == b""
    c.write(b"x")
    c.due(0.0)
    c.on_payload(_bmc(ack=9, accepted=1), 0.1)  # acknowledges nothing we sent
    assert c.pending == 1
    assert (c.counters.malformed, c.counters.stale_acks) == (1, 1)


def test_the_bmc_ending_sol_is_reported() -> None:
    c = SolCore()
    c.on_payload(_bmc(status=sol.ST_DEACTIVATING), 0.0)
    assert c.deactivated


def test_activation_answer_is_parsed() -> None:
    data = bytes([0, 0, 0, 0]) + (252).to_bytes(2, "little") + (252).to_bytes(2, "little")
    act = sol.parse_activation(data + (623).to_bytes(2, "little") + b"\xff\xff")
    assert (act.inbound_size, act.outbound_size, act.port) == (252, 252, 623)


def test_on_the_bmc_side_status_bits_are_the_consoles_operations() -> None:
    bmc = SolCore(bmc_side=True)
    bmc.on_payload(_bmc(seq=1, status=sol.OP_BREAK), 0.0)
    assert bmc.break_seen and not bmc.deactivated


def test_a_numbered_packet_without_data_is_acknowledged() -> None:
    bmc = SolCore(bmc_side=True)
    bmc.on_payload(_bmc(seq=2, status=sol.OP_BREAK), 0.0)
    [ack] = bmc.due(0.0)
    assert decode_sol(ack).ack == 2
