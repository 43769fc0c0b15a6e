"""Every name a function reads from module scope is defined there.

A missing import only fails when the function runs, and some functions run
only at the end of a many-minute engine test (an earlier CI run lost 40
minutes to ``re`` dropped from a test module's imports). This finds such
names in seconds with the standard library's symbol tables: a name that a
scope reads as global but that the module neither assigns, imports, defines
nor gets from builtins.
"""

from __future__ import annotations

import ast
import builtins
import symtable
from pathlib import Path

import pytest

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
TREES = ["lmcache_ascend", "tests", "bench", "scripts"]
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__",
                  "__path__", "__builtins__", "__annotations__"}


def undefined_globals(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(scope, line, name) for each global read of a name the module never binds."""
    tree = ast.parse(source, filename)
    if any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree)):
        return []  # a star import binds names no table lists
    top = symtable.symtable(source, filename, "exec")
    bound = set(dir(builtins)) | MODULE_DUNDERS
    bound |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    # `global x` then `x = ...` inside a function binds x at module scope too.
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            bound |= set(node.names)
    found = []

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            name = s.get_name()
            if not s.is_referenced() or name in bound:
                continue
            if table.get_type() == "module" or s.is_global():
                found.append((table.get_name(), table.get_lineno(), name))
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_the_check_finds_a_missing_import():
    src = "import os\n\ndef f(s):\n    return re.sub('a', 'b', os.sep + s)\n"
    assert undefined_globals(src, "x.py") == [("f", 3, "re")]
    assert undefined_globals("import re\n" + src, "x.py") == []


SOURCES = sorted(p for t in TREES for p in (ROOT / t).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_undefined_module_names(path):
    assert undefined_globals(path.read_text(), str(path)) == []
