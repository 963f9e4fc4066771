"""SQL statement counter for a benchmarked metald, whatever tree it comes from.

``bench/storm_compare.py`` puts this folder first on ``PYTHONPATH`` and sets
``STORM_SQLCOUNT`` to a file path; every Python process then imports this module at start
(``site`` imports ``sitecustomize``), but only a metald server (``serve`` on its command line)
counts: a listener on every SQLAlchemy engine's ``before_cursor_execute`` (the statements the
store sends, ``BEGIN`` of the store's own ``begin`` hook included), written as JSON to that file
when metald exits. The statements sent before the first machine row was inserted (migrations,
bootstrap tokens) are recorded apart as ``startup``, so ``(total - startup) / machines`` is the
storm's own cost per machine. Not used by metald itself: a bench tool."""

from __future__ import annotations

import os
import sys

_OUT = os.environ.get("STORM_SQLCOUNT")

if _OUT and "serve" in sys.argv:
    import atexit
    import json
    import re
    import threading
    from collections import Counter

    _lock = threading.Lock()
    _kinds: Counter[str] = Counter()
    _state = {"total": 0, "startup": None}
    _table = re.compile(r"\b(?:FROM|INTO|UPDATE)\s+\"?(\w+)", re.IGNORECASE)

    _log = open(os.environ["STORM_SQLLOG"], "w") if os.environ.get("STORM_SQLLOG") else None  # noqa: SIM115 - open for the process's life

    def _on_statement(_conn, _cur, statement, _params, _ctx, _many):  # type: ignore[no-untyped-def]
        if _log is not None:  # every statement, one line each (STORM_SQLLOG: debugging only)
            where = ""
            if os.environ.get("STORM_SQLSTACK"):  # the metald/api frames that sent it
                import traceback

                where = " < ".join(
                    f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.name}"
                    for f in reversed(traceback.extract_stack())
                    if "/metald/" in f.filename or "/api/" in f.filename
                )
            text = " ".join(statement.split())
            _log.write(f"{threading.current_thread().name}\t{text}\t{where}\n")
            _log.flush()
        head = statement.lstrip()[:12].split(None, 1)[0].upper() if statement.strip() else "?"
        m = _table.search(statement)
        key = f"{head} {m.group(1)}" if m else head
        with _lock:
            _state["total"] += 1
            _kinds[key] += 1
            if _state["startup"] is None and head == "INSERT" and key == "INSERT machines":
                _state["startup"] = _state["total"] - 1

    def _dump() -> None:
        with _lock:
            doc = {
                "total": _state["total"],
                "startup": _state["startup"] or 0,
                "by_kind": dict(_kinds.most_common()),
            }
        with open(_OUT, "w") as f:
            json.dump(doc, f, indent=1)

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    event.listen(Engine, "before_cursor_execute", _on_statement)
    atexit.register(_dump)

_THREADS = os.environ.get("STORM_THREADS")

if _THREADS and "serve" in sys.argv:
    # Where metald's CPU goes by thread, and the cyclic GC's share of it: a sampler thread
    # writes, every half second, each live thread's utime + stime (``/proc/self/task``) under
    # its Python name, and the GC's passes and seconds per generation. The last sample stands
    # (threads that ended keep their last reading), and the series of samples (to cut out a
    # phase: ``bench/threads_split.py``). For comparing trees, not for timing.
    import gc as _gc
    import json as _json
    import threading as _threading
    import time as _time

    _tick = os.sysconf("SC_CLK_TCK")
    _gcs = {"runs": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": [0, 0, 0]}
    _t0 = [0.0]

    def _on_gc(phase, info):  # type: ignore[no-untyped-def]
        if phase == "start":
            _t0[0] = _time.thread_time()
        else:
            g = info["generation"]
            _gcs["runs"][g] += 1
            _gcs["seconds"][g] += _time.thread_time() - _t0[0]
            _gcs["collected"][g] += info["collected"]

    _gc.callbacks.append(_on_gc)
    _seen: dict[str, float] = {}
    _series: list[tuple[float, dict[str, float]]] = []

    def _sample() -> None:
        while True:
            _time.sleep(0.5)
            names = {t.native_id: t.name for t in _threading.enumerate()}
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / _tick
                _seen[f"{names.get(int(tid), 'native')}:{tid}"] = cpu
            _series.append((_time.monotonic(), dict(_seen)))
            with open(_THREADS, "w") as f:
                _json.dump({"threads": _seen, "gc": _gcs, "series": _series}, f)

    _threading.Thread(target=_sample, name="storm-threads", daemon=True).start()
