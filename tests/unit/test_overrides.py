"""The registry of changes to LMCache's and vLLM's objects
(lmcache_bridge/patching/overrides.py): complete, gated, covered, and the only way
the package changes an upstream object.

The scan rule (test_no_attribute_of_an_upstream_object_is_set_outside_apply).
In every module of ``lmcache_ascend/``, the object whose attribute is set by
an assignment (``x.a = ...``, ``x.a += ...``, ``x.a: T = ...``), by ``del
x.a``, or by ``setattr(x, ...)`` / ``object.__setattr__(x, ...)`` /
``delattr(x, ...)`` must not be *foreign*, except inside
``overrides.apply`` / ``overrides.undo``. An expression is foreign when it
is, or is reached from (by attribute, subscript, iteration, ``getattr``,
``type``, ``list``..., or a method call on it):

* a name imported from ``lmcache`` or ``vllm`` (or ``vllm_ascend``), or the
  result of ``lmcache_modules.load(...)``, ``lmcache_modules.engine_config()``
  or ``importlib.import_module(...)``;
* a parameter whose annotation names no class defined in this package
  (``Any``, none, ``ModuleType``...); ``self``/``cls`` of a function defined
  directly in a class body is this package's, but the ``self`` of a nested
  function (a wrapper installed on an upstream class) is a parameter like any
  other;
* ``self.<x>`` where the class assigns ``self.<x>`` a foreign value;
* ``self.<m>(...)`` where the class's method ``<m>`` is annotated to return
  no class of this package;
* a local name any binding of which (assignment, ``for``, ``with``) is
  foreign in the same function.

Names bound to a new object by calling a class of this package, or of a
third-party library that is neither LMCache nor vLLM (a tokenizer the CLI
builds, a LogRecord logging's factory made), are not foreign: the package
created them. Not covered: writes through ``obj.__dict__`` and mutation of
upstream containers (``dict.setdefault`` on LMCache's config definitions),
which are method calls, not attribute assignments.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from types import SimpleNamespace

import pytest

from lmcache_ascend import compat
from lmcache_ascend.lmcache_bridge.patching import overrides
from lmcache_ascend.lmcache_bridge.patching.overrides import ENTRIES, Kind, Upstream

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_ascend"
FOREIGN_MODULES = ("lmcache", "vllm", "vllm_ascend")
FOREIGN_LOADERS = {("lmcache_modules", "load"), ("lmcache_modules", "engine_config"), ("importlib", "import_module")}
PASS_THROUGH = {"getattr", "type", "list", "tuple", "iter", "next", "reversed", "sorted", "vars"}
EXEMPT = {("lmcache_bridge/patching/overrides.py", "apply"), ("lmcache_bridge/patching/overrides.py", "undo")}


# ---- the registry's records -------------------------------------------------------


def _test_functions(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_entry_names_tests_that_exist():
    for entry in ENTRIES:
        assert entry.tests, f"{entry.name} names no test"
        for node_id in entry.tests:
            file, _, func = node_id.partition("::")
            path = ROOT / file
            assert path.is_file(), f"{entry.name}: {file} does not exist"
            assert func.split("[")[0] in _test_functions(path), f"{entry.name}: {node_id} does not exist"


def test_entries_are_unique_typed_and_verified_on_supported_releases():
    assert len({e.name for e in ENTRIES}) == len(ENTRIES)
    vllm = {f"{a}.{b}" for a, b in compat.VLLM_SERIES}
    for entry in ENTRIES:
        assert dataclasses.is_dataclass(entry) and isinstance(entry.kind, Kind)
        supported = set(compat.LMCACHE_VERSIONS) if entry.upstream is Upstream.LMCACHE else vllm
        assert entry.verified_on and set(entry.verified_on) <= supported, entry.name
        assert entry.why and entry.target
        if entry.kind is Kind.VLLM_CONFIG:
            assert entry.upstream is Upstream.VLLM, entry.name


def test_module_patches_are_the_patch_records():
    from lmcache_ascend.lmcache_bridge.patching.patches import PATCHES

    by_name = {e.name: e for e in ENTRIES}
    for patch in PATCHES:
        entry = by_name[patch.name]
        assert entry.kind is Kind.MODULE_PATCH and entry.verified_on == patch.verified_on


def test_apply_refuses_an_unverified_release_naming_the_entry(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(overrides, "_installed", lambda upstream: "9.9.9")
    target = SimpleNamespace(watermark=0.0)
    with pytest.raises(overrides.UnverifiedOverrideError) as err:
        overrides.apply(overrides.SCHEDULER_WATERMARK, target, "watermark", 0.5)
    assert "scheduler_watermark" in str(err.value) and "9.9.9" in str(err.value)
    assert target.watermark == 0.0
    # The opt-in for untested releases (compat's policy) lets it run.
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    overrides.apply(overrides.SCHEDULER_WATERMARK, target, "watermark", 0.5)
    assert target.watermark == 0.5


def test_apply_records_what_it_replaced_and_undo_puts_it_back():
    target = SimpleNamespace(store="original")
    replaced = overrides.apply(overrides.MOONCAKE_CHECKED_STORE, target, "store", "checked")
    assert target.store == "checked" and replaced.previous == "original"
    overrides.undo(replaced)
    assert target.store == "original"
    with pytest.raises(KeyError):
        overrides.apply(dataclasses.replace(overrides.MOONCAKE_CHECKED_STORE, name="x"), target, "store", 1)


# ---- the scan ---------------------------------------------------------------------------


def _package_classes() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return names


def _names_in(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


class _Scan:
    def __init__(self, rel: str, tree: ast.Module, classes: set[str]) -> None:
        self.rel, self.classes, self.found = rel, classes, []
        self.module_foreign = {
            alias.asname or alias.name.split(".")[0]
            for node in tree.body
            for alias in getattr(node, "names", ())
            if isinstance(node, (ast.Import, ast.ImportFrom)) and self._from_upstream(node, alias)
        }
        self.tree = tree

    @staticmethod
    def _from_upstream(node: ast.AST, alias: ast.alias) -> bool:
        module = node.module if isinstance(node, ast.ImportFrom) else alias.name
        return (module or "").split(".")[0] in FOREIGN_MODULES

    def run(self) -> list[str]:
        self._body(self.tree.body, None)
        return self.found

    def _body(self, body: list[ast.stmt], cls: ast.ClassDef | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                self._body(node.body, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(node, cls, set())

    def _class_info(self, cls: ast.ClassDef | None) -> tuple[set[str], set[str]]:
        """(self attributes assigned a foreign value, methods returning no package type)."""
        if cls is None:
            return set(), set()
        methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        untyped = {m.name for m in methods if not (_names_in(m.returns) & self.classes)}
        attrs: set[str] = set()
        for _ in range(3):  # a foreign attribute can make another foreign
            for method in methods:
                env = self._env(method, cls, attrs, untyped, set())
                for node in ast.walk(method):
                    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        for t in targets:
                            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                    and t.value.id == "self" and self._foreign(node.value, env, attrs, untyped)):
                                attrs.add(t.attr)
        return attrs, untyped

    def _env(self, fn, cls, attrs, untyped, outer: set[str]) -> set[str]:
        """The foreign names of ``fn`` (its parameters and locals)."""
        env = set(outer) | self.module_foreign
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        for i, arg in enumerate(args):
            if i == 0 and cls is not None and arg.arg in ("self", "cls"):
                continue
            if not (_names_in(arg.annotation) & self.classes):
                env.add(arg.arg)
        for extra in (fn.args.vararg, fn.args.kwarg):
            if extra is not None:
                env.add(extra.arg)
        for _ in range(4):  # until no new name turns foreign
            before = len(env)
            for node in ast.walk(fn):
                for name, value in self._bindings(node):
                    if self._foreign(value, env, attrs, untyped):
                        env.add(name)
            if len(env) == before:
                break
        return env

    @staticmethod
    def _bindings(node: ast.AST):
        def names(target):  # the names a target binds (not those inside x.a or x[i])
            if isinstance(target, ast.Name):
                return [target.id]
            if isinstance(target, (ast.Tuple, ast.List)):
                return [n for e in target.elts for n in names(e)]
            return names(target.value) if isinstance(target, ast.Starred) else []

        if isinstance(node, ast.Assign):
            for t in node.targets:
                yield from ((n, node.value) for n in names(t))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            yield from ((n, node.value) for n in names(node.target))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield from ((n, node.iter) for n in names(node.target))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield from ((n, node.context_expr) for n in names(node.optional_vars))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if _Scan._from_upstream(node, alias):
                    yield alias.asname or alias.name.split(".")[0], ast.Name("__upstream__")

    def _foreign(self, e: ast.AST | None, env: set[str], attrs: set[str], untyped: set[str]) -> bool:
        if e is None:
            return False
        if isinstance(e, ast.Name):
            return e.id in env or e.id == "__upstream__"
        if isinstance(e, ast.Attribute):
            if isinstance(e.value, ast.Name) and e.value.id == "self" and "self" not in env:
                return e.attr in attrs
            return self._foreign(e.value, env, attrs, untyped)
        if isinstance(e, (ast.Subscript, ast.Starred, ast.Await)):
            return self._foreign(e.value, env, attrs, untyped)
        if isinstance(e, (ast.BoolOp,)):
            return any(self._foreign(v, env, attrs, untyped) for v in e.values)
        if isinstance(e, ast.IfExp):
            return self._foreign(e.body, env, attrs, untyped) or self._foreign(e.orelse, env, attrs, untyped)
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Name) and f.id in PASS_THROUGH:
                return bool(e.args) and self._foreign(e.args[0], env, attrs, untyped)
            if isinstance(f, ast.Attribute):
                if isinstance(f.value, ast.Name) and (f.value.id, f.attr) in FOREIGN_LOADERS:
                    return True
                if isinstance(f.value, ast.Name) and f.value.id == "self" and "self" not in env:
                    return f.attr in untyped
            return self._foreign(f, env, attrs, untyped)
        return False

    def _function(self, fn, cls: ast.ClassDef | None, outer: set[str]) -> None:
        attrs, untyped = self._class_info(cls)
        env = self._env(fn, cls, attrs, untyped, outer)
        exempt = (self.rel, fn.name) in EXEMPT
        for node in self._own_nodes(fn):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(node, None, env - {a.arg for a in node.args.args})
                continue
            for obj in self._set_objects(node):
                if not exempt and self._foreign(obj, env, attrs, untyped):
                    self.found.append(f"{self.rel}:{node.lineno} in {fn.name}: {ast.unparse(node).splitlines()[0]}")

    @staticmethod
    def _own_nodes(fn):
        """``fn``'s nodes, nested functions included as nodes but not walked."""
        stack = list(ast.iter_child_nodes(fn))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.extend(ast.iter_child_nodes(node))

    @staticmethod
    def _set_objects(node: ast.AST):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("setattr", "delattr")) or (
                isinstance(f, ast.Attribute) and f.attr == "__setattr__" and ast.unparse(f.value) == "object"
            ):
                yield node.args[0]
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Attribute):
                yield t.value


def _violations() -> list[str]:
    classes = _package_classes()
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        found += _Scan(rel, ast.parse(path.read_text()), classes).run()
    return found


def test_no_attribute_of_an_upstream_object_is_set_outside_apply():
    assert _violations() == []


def test_the_scan_finds_a_direct_assignment():
    src = (
        "from typing import Any\n"
        "from vllm.config import VllmConfig\n"
        "def f(vllm_config: Any):\n"
        "    sched = vllm_config.scheduler_config\n"
        "    sched.watermark = 0.5\n"
        "class C:\n"
        "    def __init__(self, engine):\n"
        "        self._engine = engine\n"
        "        self.n = 0\n"
        "    def install(self):\n"
        "        self._engine.lookup = None\n"
        "        self.n += 1\n"
        "def g():\n"
        "    VllmConfig.x = 1\n"
        "    def __init__(self):\n"
        "        self.store = 2\n"
    )
    found = _Scan("x.py", ast.parse(src), {"C"}).run()
    assert sorted(f.split(" in ")[0] for f in found) == ["x.py:11", "x.py:14", "x.py:16", "x.py:5"], found


# ---- the entries no other test covers ----------------------------------------------


def test_load_failure_policy_becomes_recompute():
    from lmcache_ascend.integration.vllm.vllm_engine_config import ensure_recompute_on_load_failure

    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy="fail"))
    ensure_recompute_on_load_failure(cfg)
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_watermark_keeps_the_state_blocks_free():
    from lmcache_ascend.integration.vllm.vllm_engine_config import keep_admission_blocks_free

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(watermark=0.0))
    keep_admission_blocks_free(cfg, SimpleNamespace(num_blocks=100), 3)
    assert int(cfg.scheduler_config.watermark * 100) >= 3
    before = cfg.scheduler_config.watermark
    keep_admission_blocks_free(cfg, SimpleNamespace(num_blocks=100), 2)  # already enough: untouched
    assert cfg.scheduler_config.watermark == before


def test_connector_without_a_shutdown_gets_one(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from lmcache_ascend.integration.vllm import adapter_route, shutdown

    monkeypatch.setattr(shutdown, "close_before_thread_join", lambda parent, fn: None)
    class Connector:  # like vLLM 0.32's LMCacheConnectorV1: the base's shutdown
        shutdown = KVConnectorBase_V1.shutdown

    parent = Connector()
    closed = []
    adapter_route.install_shutdown(parent, lambda: closed.append(1))
    parent.shutdown()
    assert closed == [1]


def test_refused_requests_are_not_saved():
    from lmcache_ascend.lmcache_bridge.patching.adapter_shim import _drop_refused_saves

    adapter = SimpleNamespace()
    adapter.__dict__["_lmcache_ascend_refused"] = {"r1"}
    spec1, spec2 = SimpleNamespace(can_save=True), SimpleNamespace(can_save=True)
    meta = SimpleNamespace(requests=[SimpleNamespace(req_id="r1", save_spec=spec1),
                                     SimpleNamespace(req_id="r2", save_spec=spec2)])
    _drop_refused_saves(adapter, meta, SimpleNamespace(finished_req_ids={"r1"}))
    assert (spec1.can_save, spec2.can_save) == (False, True)
    assert adapter._lmcache_ascend_refused == set()


def test_engine_requirements_set_lmcache_config_fields(monkeypatch):
    from lmcache_ascend.lmcache_bridge.engine import config as bridge_config

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    algo = next(iter(bridge_config._NON_CRYPTO_HASHES))
    cfg = SimpleNamespace(save_unfull_chunk=True, pre_caching_hash_algorithm=algo, enable_async_loading=False,
                          use_layerwise=False, enable_blending=False, remote_url=None, extra_config=None)
    try:
        bridge_config.enforce_engine_requirements(cfg, 2, connector="test")
    except (AttributeError, TypeError) as exc:  # a field this fake lacks: name it
        pytest.fail(f"enforce_engine_requirements needs more of LMCache's config: {exc!r}")
    assert cfg.save_unfull_chunk is False
    assert cfg.pre_caching_hash_algorithm == bridge_config.DETERMINISTIC_HASH


def test_mooncake_connector_gets_a_checked_store():
    pytest.importorskip("lmcache.v1.storage_backend.connector.mooncakestore_connector")
    from lmcache.v1.storage_backend.connector import mooncakestore_connector as mod

    from lmcache_ascend.lmcache_bridge.backends import mooncake

    mooncake.install_failure_accounting()
    assert mod._lmcache_ascend_checked is True
    wrapper = mod.MooncakestoreConnector.__init__
    cell = wrapper.__closure__[wrapper.__code__.co_freevars.index("original_init")]
    lmcaches = cell.cell_contents
    # LMCache's own __init__ needs a live store: stand in for it, keep ours.
    cell.cell_contents = lambda self, *a, **k: setattr(self, "store", object())
    try:
        connector = mod.MooncakestoreConnector.__new__(mod.MooncakestoreConnector)
        wrapper(connector)
    finally:
        cell.cell_contents = lmcaches
    assert isinstance(connector.store, mooncake.CheckedStore)


def test_detached_remote_backend_has_no_connection():
    import asyncio
    import threading

    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    from lmcache_ascend.lmcache_bridge.engine.resources import detach_remote_backends

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        backend = RemoteBackend.__new__(RemoteBackend)
        backend.connection = SimpleNamespace()
        backend.loop = loop
        engine = SimpleNamespace(storage_manager=SimpleNamespace(storage_backends={"remote": backend}))
        detach_remote_backends(engine, timeout=5)
        assert backend.connection is None
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_reconnector_clears_lmcaches_wait(monkeypatch):
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    from lmcache_ascend.lmcache_bridge.backends import remote_pool

    backend = RemoteBackend.__new__(RemoteBackend)
    backend.connection = None
    backend.failure_time = 123.0
    backend.remote_url = "lm://127.0.0.1:1"
    seen = []
    backend.init_connection = lambda: seen.append(backend.failure_time)
    engine = SimpleNamespace(storage_manager=SimpleNamespace(storage_backends={"remote": backend}))
    monkeypatch.setattr(remote_pool, "unreachable", lambda *a: None)
    reconnector = remote_pool.Reconnector(engine)
    reconnector.attempt()
    assert seen == [0]
