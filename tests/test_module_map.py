"""docs/architecture.md's module map of the daemon stays true to the code.

The table in section 11 is what a reader uses to find who owns a piece of
state; these tests fail as soon as a module is added, removed or grows without
the table following, and when a class of the daemon creates an attribute
outside ``__init__`` (state that appears later, on some thread, is how the
god class this map replaced came to be).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
HEADER = "| module | lines | process | owner thread | what it owns |"
SIZE_LIMIT = 420  # "~400 lines" for every module the kvswapd process runs


@dataclass(frozen=True)
class Row:
    module: str
    lines: int
    process: str
    owner: str


def _rows() -> list[Row]:
    text = DOC.read_text()
    start = text.index(HEADER)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.fullmatch(r"`([^`]+)`", cells[0])
        assert m, f"module cell {cells[0]!r} is not one `path`"
        rows.append(Row(m.group(1), int(cells[1]), cells[2], cells[3]))
    return rows


ROWS = _rows()


def _line_count(path: Path) -> int:
    with path.open() as f:
        return sum(1 for _ in f)


def test_every_daemon_module_is_listed_once_and_every_listed_one_exists():
    listed = [r.module for r in ROWS]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    actual = {str(p.relative_to(ROOT)) for p in (ROOT / "daemon").rglob("*.py")}
    assert sorted(set(listed) - actual) == [], "listed but missing"
    assert sorted(actual - set(listed)) == [], "in daemon/ but not in the module map"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.module)
def test_line_count_is_true_to_within_ten_percent(row: Row):
    n = _line_count(ROOT / row.module)
    assert abs(n - row.lines) <= max(3, n // 10), (
        f"{row.module} has {n} lines, the module map says {row.lines}: update "
        f"docs/architecture.md section 11")


@pytest.mark.parametrize("row", [r for r in ROWS if r.process == "kvswapd"],
                         ids=lambda r: r.module)
def test_daemon_modules_stay_small(row: Row):
    n = _line_count(ROOT / row.module)
    assert n <= SIZE_LIMIT, (f"{row.module} has {n} lines; a module of kvswapd stays under "
                             f"{SIZE_LIMIT}: split it by role and add the part to the map")
    assert row.owner, f"{row.module}: name the thread that owns its state"


def _late_attributes(tree: ast.Module) -> list[str]:
    """``Class.method: self.attr`` for each attribute first assigned outside
    ``__init__`` (dataclasses and other classes without ``__init__`` are skipped)."""
    late = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
        init = next((m for m in methods if m.name == "__init__"), None)
        if init is None:
            continue

        def assigned(fn: ast.FunctionDef) -> set[str]:
            names = set()
            for node in ast.walk(fn):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                           else [])
                for t in targets:
                    for e in ast.walk(t):
                        if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                                and e.value.id == "self"):
                            names.add(e.attr)
            return names

        created = assigned(init)
        for m in methods:
            if m is not init:
                late += [f"{cls.name}.{m.name}: self.{a}" for a in sorted(assigned(m) - created)]
    return late


@pytest.mark.parametrize("row", [r for r in ROWS if r.process == "kvswapd"],
                         ids=lambda r: r.module)
def test_daemon_classes_create_their_attributes_in_init(row: Row):
    tree = ast.parse((ROOT / row.module).read_text())
    assert _late_attributes(tree) == []


def test_the_attribute_check_can_fail():
    tree = ast.parse("class A:\n    def __init__(self):\n        self.a = 1\n"
                     "    def later(self):\n        self.a = 2\n        self.b, self.c = 3, 4\n")
    assert _late_attributes(tree) == ["A.later: self.b", "A.later: self.c"]
