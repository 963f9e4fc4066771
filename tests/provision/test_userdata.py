"""Tenants' user-data: the forms cloud-init runs, size limits, and cloud-config checked against
cloud-init's own schema. The verdicts are compared with Debian's cloud-init itself (its
``validate_cloudconfig_schema``, run by the system Python that package installs into)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from metald.provision import userdata
from metald.provision.userdata import UserDataError, check

HAVE_SCHEMA = Path(userdata.DEBIAN_SCHEMA).exists()
needs_schema = pytest.mark.skipif(
    not HAVE_SCHEMA, reason="Debian's cloud-init package is not installed (scripts/bootstrap)"
)

MULTIPART = """Content-Type: multipart/mixed; boundary="==XX=="
MIME-Version: 1.0

--==XX==
Content-Type: text/cloud-config; charset="us-ascii"

packages: [htop]
write_files:
  - path: /etc/tenant
    content: hello
--==XX==
Content-Type: text/x-shellscript; charset="us-ascii"

#!/bin/sh
echo hi > /root/hi
--==XX==--
"""


@needs_schema
def test_forms() -> None:
    cc = "#cloud-config\npackages: [htop]\nruncmd: [[touch, /x]]\n"
    assert check(cc).form == "cloud-config"
    assert check("#!/bin/bash\necho hi\n").form == "script"
    assert check("#cloud-boothook\n#!/bin/sh\necho\n").form == "boothook"
    assert check("#include\nhttps://example.test/ud\n").form == "include"
    assert check("## template: jinja\n#cloud-config\nhostname: {{ v1.local_hostname }}\n").form == (
        "jinja"
    )
    got = check(MULTIPART)
    assert got.form == "multipart" and got.parts == ("cloud-config", "script")
    assert got.sha256 == __import__("hashlib").sha256(MULTIPART.encode()).hexdigest()


@needs_schema
def test_refusals_say_why() -> None:
    with pytest.raises(UserDataError, match=r"packages: 5 is not of type 'array'"):
        check("#cloud-config\npackages: 5\n")
    with pytest.raises(UserDataError, match="not valid YAML at line 3"):
        check("#cloud-config\npackages: [a\n")
    with pytest.raises(UserDataError, match="must be a mapping"):
        check("#cloud-config\n- a\n- b\n")
    with pytest.raises(UserDataError, match="must start with #cloud-config"):
        check("packages: [htop]\n")
    with pytest.raises(UserDataError, match="more than the 1024 allowed"):
        check("#!/bin/sh\n" + "#" * 2000, max_bytes=1024)
    bad = MULTIPART.replace("packages: [htop]", "users: 7")
    with pytest.raises(UserDataError, match=r"multipart part 1 \(text/cloud-config\)"):
        check(bad)
    with pytest.raises(UserDataError, match="cloud-init ignores"):
        check(MULTIPART.replace("text/x-shellscript", "application/octet-stream"))


def test_no_schema_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserDataError, match="no cloud-init schema at"):
        check("#cloud-config\npackages: [a]\n", schema_path=str(tmp_path / "none.json"))


# Values that are right for some keys and wrong for others: the schema decides.
_KEYS = [
    "packages",
    "runcmd",
    "write_files",
    "users",
    "ssh_authorized_keys",
    "hostname",
    "package_update",
    "bootcmd",
    "timezone",
    "ntp",
    "apt",
    "disable_root",
    "mounts",
    "swap",
    "final_message",
    "groups",
    "chpasswd",
    "growpart",
    "resize_rootfs",
    "locale",
]
_VALUES: list[object] = [
    5,
    True,
    "text",
    ["a", "b"],
    [["ls", "-l"]],
    {"enabled": True},
    [{"path": "/etc/x"}],
    [{"name": "bob", "sudo": "ALL=(ALL) NOPASSWD:ALL"}],
    {"servers": ["ntp.test"]},
    None,
    [{"path": "/x", "content": "y", "permissions": "0644"}],
    {"expire": False},
    "noblock",
    {"filename": "/swap", "size": "auto"},
    [5],
    {"mode": "auto", "devices": ["/"]},
]


@needs_schema
@pytest.mark.skipif(not shutil.which("cloud-init"), reason="Debian's cloud-init not installed")
def test_same_verdicts_as_cloud_init() -> None:
    """200 random cloud-configs: metald accepts exactly those cloud-init's schema accepts."""
    rng = random.Random(32)
    configs = [
        {k: rng.choice(_VALUES) for k in rng.sample(_KEYS, rng.randint(1, 2))} for _ in range(200)
    ]
    ours = []
    for c in configs:
        try:
            check("#cloud-config\n" + json.dumps(c))
            ours.append(True)
        except UserDataError:
            ours.append(False)
    prog = (
        "import json, sys\n"
        "from cloudinit.config.schema import get_schema, validate_cloudconfig_schema, "
        "SchemaValidationError\n"
        "schema = get_schema(); out = []\n"
        "for c in json.load(sys.stdin):\n"
        "    try:\n"
        "        validate_cloudconfig_schema(c, schema, strict=True); out.append(True)\n"
        "    except SchemaValidationError:\n"
        "        out.append(False)\n"
        "print(json.dumps(out))\n"
    )
    real = subprocess.run(
        ["/usr/bin/python3", "-c", prog],
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    theirs = json.loads(real.stdout.strip().splitlines()[-1])
    diff = [(c, o, t) for c, o, t in zip(configs, ours, theirs, strict=True) if o != t]
    assert not diff, diff[:3]
    assert 10 < sum(theirs) < 190  # both verdicts are exercised


@needs_schema
def test_hostile_yaml_is_refused_quickly() -> None:
    """A few hundred bytes of nested aliases stand for 10^9 values: refused before the schema
    walks them; values YAML types but cannot build are a refusal, not a crash."""
    lines = ["#cloud-config", 'a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 10):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    bomb = "\n".join(lines) + "\nruncmd: *a9\n"
    assert len(bomb) < 1024
    with pytest.raises(UserDataError, match="expands to more than"):
        check(bomb)
    with pytest.raises(UserDataError, match="not valid YAML"):
        check("#cloud-config\nfinal_message: 2001-13-45\n")
    deep = "#cloud-config\nruncmd: " + "[" * 30000 + "]" * 30000 + "\n"
    with pytest.raises(UserDataError, match="nested deeper than 64"):
        check(deep)
    assert (
        check('#cloud-config\nwrite_files: [{path: /x, content: "[{}]"}]\n').form == "cloud-config"
    )
