"""The console's memory bounds: the 64 KiB ring for late viewers, and a slow viewer cut off
instead of queueing without end."""

from __future__ import annotations

from metald.bmc.console import MAX_QUEUED, RING_BYTES, RingBuffer, Viewer


def test_the_ring_keeps_the_last_64_kib_in_order() -> None:
    ring = RingBuffer()
    for i in range(100):
        ring.append(f"{i:04d}".encode() * 256)  # 1 KiB each
    snap = ring.snapshot()
    assert len(snap) == RING_BYTES == 64 * 1024
    assert snap.startswith(b"0036") and snap.endswith(b"0099")


async def test_a_viewer_that_falls_behind_is_cut_off_with_a_reason() -> None:
    v = Viewer(actor="technician:slow", writer=False)
    for _ in range(MAX_QUEUED):
        v.offer(b"x")
    assert v.cut_reason is None
    v.offer(b"one too many")
    assert v.cut_reason is not None and "behind" in v.cut_reason
    items = [v.queue.get_nowait() for _ in range(v.queue.qsize())]
    assert items[-1] is None and len(items) == MAX_QUEUED
    v.offer(b"more")  # nothing is queued after the cut
    assert v.queue.qsize() == 0
