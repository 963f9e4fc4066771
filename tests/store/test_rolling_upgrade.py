"""Rolling upgrade (docs/fleet.md, "Rolling upgrade"): release N and N+1 run on one schema, so
every migration after the baseline is *expand-only* unless it declares itself a contract
migration (``contract = True``, shipped one release after the code stopped using what it drops).

What this proves: no migration after ``BASELINE`` drops, renames or retypes a column or table,
tightens a column to NOT NULL, or adds a NOT NULL column without a server default (release N's
INSERTs do not name it), in its ``upgrade()``, unless marked contract. It reads the migration's
source (alembic ``op``/``batch_op`` calls and raw ``op.execute`` SQL): a change made some other
way (a function it calls, SQL built at run time) is not seen. It does not prove that release
N's queries work on the new schema (that needs N's code; see the docs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from metald.store.db import MIGRATIONS_DIR

#: Revisions after this one are checked. Every migration so far is expand-only, so all are;
#: raise it only to exempt history, never to let a new migration through.
BASELINE = "0000"

_ALWAYS_CONTRACT = {"drop_column", "drop_table", "rename_table", "drop_constraint"}
_RAW_CONTRACT = re.compile(
    r"\b(DROP\s+(COLUMN|TABLE|CONSTRAINT)|RENAME|ALTER\s+COLUMN\s+\S+\s+(TYPE|SET\s+NOT\s+NULL))\b",
    re.I,
)


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_false(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _column_not_null_without_default(col: ast.expr) -> bool:
    if not (isinstance(col, ast.Call) and getattr(col.func, "attr", None) == "Column"):
        return False
    if any(k.arg == "primary_key" for k in col.keywords):
        return False
    return _is_false(_kw(col, "nullable")) and _kw(col, "server_default") is None


def contract_changes(source: str) -> list[str]:
    """What ``upgrade()`` in a migration's source does that release N's code may not survive."""
    tree = ast.parse(source)
    up = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "upgrade"), None
    )
    if up is None:
        return []
    found = []
    for node in ast.walk(up):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, line = node.func.attr, node.lineno
        if name in _ALWAYS_CONTRACT:
            found.append(f"line {line}: {name}")
        elif name == "alter_column":
            if _kw(node, "type_") is not None or _kw(node, "new_column_name") is not None:
                found.append(f"line {line}: alter_column changes a type or a name")
            if _is_false(_kw(node, "nullable")):
                found.append(f"line {line}: alter_column makes a column NOT NULL")
        elif name == "add_column":
            cols = [a for a in node.args if isinstance(a, ast.Call)]
            if any(_column_not_null_without_default(c) for c in cols):
                found.append(f"line {line}: add_column NOT NULL without a server_default")
        elif name == "execute":
            sql = " ".join(
                a.value
                for a in ast.walk(node)
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            )
            if _RAW_CONTRACT.search(sql):
                found.append(f"line {line}: raw SQL drops, renames or retypes")
    return found


def _migrations() -> list[tuple[str, Path]]:
    out = []
    for p in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        m = re.search(r"^revision(?:\s*:[^=]*)?\s*=\s*[\"']([^\"']+)[\"']", p.read_text(), re.M)
        assert m, p
        out.append((m.group(1), p))
    return out


def _is_contract(source: str) -> bool:
    return re.search(r"^contract\s*=\s*True\b", source, re.M) is not None


@pytest.mark.parametrize(
    ("rev", "path"), [(r, p) for r, p in _migrations() if r > BASELINE], ids=lambda x: str(x)
)
def test_migrations_after_the_baseline_only_expand(rev: str, path: Path) -> None:
    source = path.read_text()
    if _is_contract(source):
        return
    changes = contract_changes(source)
    assert not changes, (
        f"migration {rev} ({path.name}) is not expand-only: {changes}. Release N still runs on "
        "this schema during a rolling upgrade: add instead (nullable, or with a server_default), "
        "and drop in a later migration marked `contract = True` (docs/fleet.md, Rolling upgrade)"
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "def upgrade():\n    op.add_column('t', sa.Column('x', sa.Integer(), nullable=True))\n",
            [],
        ),
        (
            "def upgrade():\n    op.add_column('t', sa.Column('x', sa.Integer(), nullable=False,"
            " server_default='0'))\n",
            [],
        ),
        (
            "def upgrade():\n    op.add_column('t', sa.Column('x', sa.Integer(), nullable=False))\n",
            ["line 2: add_column NOT NULL without a server_default"],
        ),
        (
            "def upgrade():\n    with op.batch_alter_table('t') as b:\n        b.drop_column('x')\n",
            ["line 3: drop_column"],
        ),
        (
            "def upgrade():\n    op.alter_column('t', 'x', new_column_name='y')\n",
            ["line 2: alter_column changes a type or a name"],
        ),
        (
            "def upgrade():\n    op.alter_column('t', 'x', nullable=False)\n",
            ["line 2: alter_column makes a column NOT NULL"],
        ),
        (
            "def upgrade():\n    op.execute('ALTER TABLE t DROP COLUMN x')\n",
            ["line 2: raw SQL drops, renames or retypes"],
        ),
        ("def upgrade():\n    op.execute('UPDATE t SET x = 1')\n", []),
        # A downgrade may drop what its upgrade added: only upgrade() runs in a rolling upgrade.
        ("def upgrade():\n    pass\ndef downgrade():\n    op.drop_column('t', 'x')\n", []),
    ],
)
def test_the_checker_sees_contract_changes(source: str, expected: list[str]) -> None:
    assert contract_changes(source) == expected
