"""Imports point down, and importing a package changes nothing.

The package's floors, lowest first: ``planning`` (pure), ``transfer``,
``lmcache_bridge`` (every LMCache seam), ``integration`` (reads vLLM's
types; the entry points), ``cli``. A module may import its own floor and
those below it, never one above: every lower->upper pair is checked. The
bridge's rooms (``engine``, ``integrity``, ``backends``, ``patching``) are
one floor: a module in any of them is held to the bridge's rule, and every
bridge module sits in a room its ``__init__`` names it in.

Top-level modules sit below every floor: ``compat.py`` (supported versions,
imported by ``lmcache_bridge`` and ``integration``), ``ops.py`` /
``_native.py`` / ``_build_info.py`` (the compiled ops and their loader,
imported lazily by ``transfer``). They import no floor. Two floors are kept
narrower than their place says, as the code stands: ``planning`` imports
none of them (no version questions, no compiled module), ``transfer`` no
``compat``. The package ``__init__`` imports nothing of the package at all:
``import lmcache_ascend`` runs no integration code and installs no hook.

Read from the sources (every import statement, also inside functions, and
``importlib.import_module`` / ``__import__`` with a constant name), so a lazy
import that only runs in an engine is caught too; and checked in a fresh
interpreter for what an import actually loads and installs.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import fresh_python
import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_ascend"

FLOORS = ("planning", "transfer", "lmcache_bridge", "integration", "cli")
TOP_LEVEL = ("compat", "ops", "_native", "_build_info", "_ops")
PACKAGE_INIT = "lmcache_ascend"  # the unit of the package __init__ itself


def _forbidden_units() -> dict[str, frozenset[str]]:
    rules: dict[str, set[str]] = {floor: set(FLOORS[i + 1:]) for i, floor in enumerate(FLOORS)}
    rules["planning"] |= set(TOP_LEVEL)
    rules["transfer"].add("compat")
    for name in TOP_LEVEL:
        rules[name] = set(FLOORS)
    rules[PACKAGE_INIT] = set(FLOORS) | set(TOP_LEVEL)
    return {unit: frozenset(names) for unit, names in rules.items()}


FORBIDDEN = _forbidden_units()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str | None:
    """The floor or top-level module ``module`` belongs to; None outside the
    package. ``lmcache_ascend`` itself is the package __init__."""
    parts = module.split(".")
    if parts[0] != "lmcache_ascend":
        return None
    return parts[1] if len(parts) > 1 else PACKAGE_INIT


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


def upward_imports(path: Path) -> list[str]:
    module = _module_name(path)
    forbidden = FORBIDDEN[unit_of(module)]
    return [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for line, name in imported_names(path.read_text(), module, path.name == "__init__.py")
        if unit_of(name) in forbidden
    ]


def test_the_rules_forbid_every_lower_to_upper_pair():
    for i, lower in enumerate(FLOORS):
        for upper in FLOORS[i + 1:]:
            assert upper in FORBIDDEN[lower], (lower, upper)
        for below in FLOORS[:i]:
            assert below not in FORBIDDEN[lower], (lower, below)
    for name in TOP_LEVEL:
        assert set(FLOORS) <= FORBIDDEN[name]
    assert set(FLOORS) | set(TOP_LEVEL) <= FORBIDDEN[PACKAGE_INIT]


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
           if unit_of(name) == "integration"]
    assert sorted(line for line, _ in got) == [1, 3, 3, 4, 4, 5, 6]
    assert (4, "lmcache_ascend.integration.vllm") in got
    # A room of the bridge is on the bridge's floor, relative imports included.
    assert unit_of("lmcache_ascend.lmcache_bridge.engine.lmcache_engine") == "lmcache_bridge"
    assert [unit_of(name) for _, name in imported_names(
        "from ...integration import wiring\n", "lmcache_ascend.lmcache_bridge.engine.x")] == ["integration"] * 2
    assert unit_of("lmcache_ascend.compat") == "compat" and unit_of("lmcache_ascend") == PACKAGE_INIT
    assert unit_of("lmcache") is None and unit_of("vllm.config") is None


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_sources_are_found_and_each_has_a_floor():
    names = {_module_name(p) for p in SOURCES}
    for expected in (
        "lmcache_ascend",
        "lmcache_ascend.compat",
        "lmcache_ascend.ops",
        "lmcache_ascend.planning.planner",
        "lmcache_ascend.transfer.chunk_transfer",
        "lmcache_ascend.lmcache_bridge.patching.adapter_shim",
        "lmcache_ascend.lmcache_bridge.engine.lmcache_engine",
        "lmcache_ascend.integration.vllm.adapter_route",
        "lmcache_ascend.cli.main",
    ):
        assert expected in names
    # A new subpackage or top-level module needs a place in the rules first.
    assert not {unit_of(n) for n in names} - set(FORBIDDEN), sorted({unit_of(n) for n in names} - set(FORBIDDEN))


BRIDGE = PACKAGE / "lmcache_bridge"
BRIDGE_ROOMS = ("engine", "integrity", "backends", "patching")


def test_every_bridge_module_is_in_a_room_its_init_names():
    # The bridge is sorted by concern (issue 35): no module on its bare
    # floor, no room but these, and each room's docstring lists its modules
    # (``name``), so the folder and what it says of itself agree.
    loose = sorted(p.name for p in BRIDGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"bridge modules outside a room: {loose}"
    rooms = sorted(p.name for p in BRIDGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(BRIDGE_ROOMS)
    for room in BRIDGE_ROOMS:
        doc = ast.get_docstring(ast.parse((BRIDGE / room / "__init__.py").read_text())) or ""
        unnamed = sorted(p.stem for p in (BRIDGE / room).glob("*.py")
                         if p.name != "__init__.py" and f"``{p.stem}``" not in doc)
        assert not unnamed, f"lmcache_bridge/{room}/__init__.py does not name {unnamed}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    bad = upward_imports(path)
    assert not bad, "imports pointing up (move the code, or register it from above):\n" + "\n".join(bad)


# What an import may not leave behind: the vLLM integration, the command
# line, vLLM, LMCache, or the bridge's import hook.
_PROBE = r"""
import json, sys
before = list(sys.meta_path)
try:
    __import__(sys.argv[1])
except ImportError as e:  # only the compiled ops may be missing (not built here)
    if sys.argv[1] != "lmcache_ascend.ops":
        raise
    print(json.dumps({"skip": str(e)}))
    raise SystemExit(0)
hook = sys.modules.get("lmcache_ascend.lmcache_bridge.patching.hook")
registry = sys.modules.get("lmcache_ascend.lmcache_bridge.patching.route_registry")
print(json.dumps({
    "upper": sorted(m for m in sys.modules
                    if m.split(".")[:2] in (["lmcache_ascend", "integration"], ["lmcache_ascend", "cli"])),
    "foreign": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "lmcache")),
    "meta_path_added": [repr(f) for f in sys.meta_path if f not in before],
    "meta_path_same": sys.meta_path == before,
    "hook_installed": bool(hook is not None and hook._installed),
    "route_registered": bool(registry is not None and registry._route is not None),
}))
"""

FRESH_IMPORTS = (
    "lmcache_ascend",
    "lmcache_ascend.planning",
    "lmcache_ascend.planning.planner",
    "lmcache_ascend.planning.store_runs",
    "lmcache_ascend.transfer.chunk_transfer",
    "lmcache_ascend.compat",
    "lmcache_ascend.ops",
    "lmcache_ascend.lmcache_bridge",
    # Its rooms (each __init__ only says what is in it).
    "lmcache_ascend.lmcache_bridge.engine",
    "lmcache_ascend.lmcache_bridge.integrity",
    "lmcache_ascend.lmcache_bridge.backends",
    "lmcache_ascend.lmcache_bridge.patching",
    # Importing the hook module itself installs nothing either.
    "lmcache_ascend.lmcache_bridge.patching.hook",
)


@pytest.mark.parametrize("module", FRESH_IMPORTS)
def test_importing_a_lower_package_loads_no_upper_code_and_installs_nothing(module):
    out = fresh_python.run(_PROBE, module, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"lmcache_ascend.ops not importable here: {got['skip']}")
    assert got == {
        "upper": [],
        "foreign": [],
        "meta_path_added": [],
        "meta_path_same": True,
        "hook_installed": False,
        "route_registered": False,
    }
