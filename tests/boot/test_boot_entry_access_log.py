"""``python -m metald.boot`` logs each HTTP request at info unless ``--no-access-log`` (what the
HTTP benches run, as their nginx runs ``access_log off`` and the daemon's listeners keep none)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vmlab.labnet import HTTP_BOOT, NEED_ROOT, ROOT, BootProcess, namespaces, write_config

GET = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
"""


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason=NEED_ROOT)
def test_access_log_is_kept_unless_turned_off(tmp_path: Path) -> None:
    root = tmp_path / "assets"
    root.mkdir()
    (root / "hello.txt").write_text("hello")
    logs = {}
    with namespaces("acc") as ns:
        for n, on in enumerate((True, False)):
            port = 8170 + n
            cfg = write_config(
                tmp_path / f"m{n}.toml",
                state_dir=tmp_path / f"st{n}",
                boot=HTTP_BOOT.format(root=root, tftp_port=6970 + n),
                listen=f"127.0.0.1:{port}",
            )
            log = tmp_path / f"m{n}.log"
            proc = BootProcess(ns["acc"], cfg, log, access_log=on).start()
            try:
                url = f"http://127.0.0.1:{port}/boot/assets/hello.txt"
                out = ns["acc"].run(sys.executable, "-c", GET, url, timeout=20).stdout
                assert out.strip() == "hello"
            finally:
                proc.stop()
            logs[on] = log.read_text()
    assert "GET /boot/assets/hello.txt" in logs[True], logs[True][-2000:]
    assert "GET /boot/assets/hello.txt" not in logs[False], logs[False][-2000:]
