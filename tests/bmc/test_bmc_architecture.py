"""metald.bmc's modules meet through public names only.

A module may use its own ``_``-prefixed names (and ``self._x`` / ``cls._x`` on its own classes),
never another module's: no ``from metald.bmc.x import _private``, no ``obj._private`` on an object
that came from elsewhere (a driver's session, the executor's fence). What another module needs is
made public and named in its interface, so a refactor of one module cannot silently break a
caller that reached into it. Dunder names are Python's, not private.
"""

from __future__ import annotations

import ast
from pathlib import Path

import metald.bmc

BMC = Path(metald.bmc.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(source: str) -> list[str]:
    """Each place in ``source`` that imports a private name from another module or reads a
    private attribute of something other than ``self``/``cls`` (or a name the module itself
    defines at top level), as ``line: text``."""
    tree = ast.parse(source)
    own = {
        n.name
        for n in tree.body
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    }
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ({"self", "cls"} | own):
                continue
            if (
                isinstance(base, ast.Call)
                and isinstance(base.func, ast.Name)
                and base.func.id == "super"
            ):
                continue
            found.append(f"{node.lineno}: .{node.attr} on {ast.unparse(base)}")
    return found


def test_the_check_sees_both_kinds_of_reach() -> None:
    src = (
        "from metald.bmc.ipmi import _Datagrams\n"
        "class A:\n"
        "    def f(self, control):\n"
        "        self._ok = 1\n"
        "        return control._fence(1)\n"
    )
    assert private_reaches(src) == [
        "1: from metald.bmc.ipmi import _Datagrams",
        "5: ._fence on control",
    ]


def test_no_bmc_module_reaches_into_another() -> None:
    found = {
        path.name: hits
        for path in sorted(BMC.glob("*.py"))
        if (hits := private_reaches(path.read_text()))
    }
    assert found == {}, f"private names used across modules in metald/bmc: {found}"
