"""Imports point down: nothing under lmcache_bridge/, planning/ or transfer/
imports the vLLM integration (lmcache_ascend.integration).

Read from the sources (every import statement, also inside functions, and
``importlib.import_module`` / ``__import__`` with a constant name), so a lazy
import that only runs in an engine is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_ascend"
LOWER = ("lmcache_bridge", "planning", "transfer")
FORBIDDEN = "lmcache_ascend.integration"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base)
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from lmcache_ascend import integration` names the package too.
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _forbidden(name: str) -> bool:
    return name == FORBIDDEN or name.startswith(FORBIDDEN + ".")


def test_the_check_finds_each_kind_of_import():
    src = (
        "import lmcache_ascend.integration.vllm.wiring\n"
        "def f():\n"
        "    from lmcache_ascend.integration.vllm import vllm_specs\n"
        "    from ..integration.vllm import shutdown\n"
        "    from lmcache_ascend import integration\n"
        "    importlib.import_module('lmcache_ascend.integration.vllm.adapter_route')\n"
        "import lmcache_ascend.integrations_elsewhere\n"
    )
    got = [(line, name) for line, name in imported_names(src, "lmcache_ascend.lmcache_bridge.x")
           if _forbidden(name)]
    assert sorted(line for line, _ in got) == [1, 3, 3, 4, 4, 5, 6]
    assert (4, "lmcache_ascend.integration.vllm") in got


SOURCES = sorted(p for d in LOWER for p in (PACKAGE / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_sources_are_found():
    names = {_module_name(p) for p in SOURCES}
    assert "lmcache_ascend.lmcache_bridge.adapter_shim" in names
    assert "lmcache_ascend.planning.planner" in names
    assert "lmcache_ascend.transfer.chunk_transfer" in names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_lower_layers_do_not_import_the_vllm_integration(path):
    module = _module_name(path)
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for line, name in imported_names(path.read_text(), module, path.name == "__init__.py")
        if _forbidden(name)
    ]
    assert not bad, "imports pointing up (move the code, or register it from above):\n" + "\n".join(bad)
