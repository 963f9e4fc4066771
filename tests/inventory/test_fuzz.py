"""Property tests: any JSON value either parses or raises InventoryError; the agent's shell
JSON escaping round-trips any string (minus the bytes it drops on purpose)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metald.inventory import normalize, parse_payload
from metald.inventory.schema import InventoryError
from tests.inventory.conftest import AGENT, payload

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_arbitrary_json_is_refused_cleanly(value):
    with pytest.raises(InventoryError):
        parse_payload(value)


@given(
    st.sampled_from(
        ["system", "cpu", "memory", "disks", "nics", "pci", "raw", "sequence", "boot_id"]
    ),
    json_values,
)
def test_replacing_any_section_with_junk_is_refused_or_normalises(key, junk):
    data = payload()
    data[key] = junk
    try:
        p = parse_payload(data)
    except InventoryError:
        return
    normalize(p)  # whatever parses must normalise without error


BUSYBOX = shutil.which("busybox")


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), max_size=40))
def test_agent_json_escaping_round_trips(text):
    script = f'. "{AGENT}"; js "$1"'
    out = subprocess.run(
        [BUSYBOX, "sh", "-c", script, "js", text],
        env={"METALD_AGENT_LIB": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=True,
    ).stdout
    decoded = json.loads(out.decode("ascii"))  # always ASCII JSON
    # the agent drops control bytes (but tab, CR, LF) and non-ASCII, and a final newline
    # (awk reads lines); nothing else changes. Only the empty string is null.
    kept = "".join(c for c in text if (32 <= ord(c) < 127) or c in "\t\r\n")
    expected = None if text == "" else kept.removesuffix("\n")
    assert decoded == expected
