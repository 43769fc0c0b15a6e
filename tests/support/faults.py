"""Fault injection for the reliability tests (opt-in, test-only).

Production code carries no test hooks. Faults are injected by a *subclass*
of the real connector, ``FaultyLMCacheAscendConnectorV1Dynamic``, which a
test selects explicitly through vLLM's ``kv_transfer_config``::

    {"kv_connector": "FaultyLMCacheAscendConnectorV1Dynamic",
     "kv_connector_module_path": "faults",
     "kv_role": "kv_both"}

This module is test support and is not shipped: the engine processes find it
through ``PYTHONPATH`` (``support_env``).

It behaves exactly like ``LMCacheAscendConnectorV1Dynamic`` unless one of
these environment variables is set (vLLM's engine-core process inherits
them from the process that builds the engine):

``LMCA_FAULT_STORE_FAIL``
    Make the copy of a chunk from vLLM's KV into LMCache's buffer raise
    ``InjectedFault``: ``all``, ``N`` (the first N chunk copies) or
    ``every:K`` (every K-th chunk copy).
``LMCA_FAULT_LOAD_FAIL``
    Same forms, for the copy of a chunk from LMCache's buffer into vLLM's KV.
``LMCA_FAULT_RANK``
    Arm the two copy faults above on this tensor-parallel rank only (its
    rank in vLLM's TP group): the other ranks copy normally.
``LMCA_FAULT_PID`` and ``LMCA_FAULT_SIGNALS``
    Send signals to the process ``LMCA_FAULT_PID`` (e.g. a redis-server)
    just before the scheduler looks up its K-th request (1-based):
    ``LMCA_FAULT_SIGNALS="3:KILL"`` kills it before the 3rd request,
    ``"2:STOP,4:CONT"`` freezes it for two requests. With sequentially
    submitted prompts these are deterministic points between requests.

``LMCA_FAULT_AFTER_LOOKUP``
    Actions run right after the scheduler looked up its K-th request, i.e.
    between that request's lookup and its load: ``"2:dropkeys:PORT"``
    deletes that request's chunks from the Redis on 127.0.0.1:PORT,
    ``"3:kill:PID"`` SIGKILLs a process (e.g. the redis-server);
    comma-separated.
``LMCA_FAULT_BEFORE_LOOKUP``
    The same, run just before the K-th lookup (after the signals), plus
    ``"2:waitport:PORT"`` (wait until something listens on 127.0.0.1:PORT),
    ``"2:sleep:S"`` and ``"2:flipchunk:C"``:
    flip bytes in the file of chunk C of that request's prompt in LMCache's
    local disk backend (``LMCACHE_LOCAL_DISK``, chunks of
    ``LMCACHE_CHUNK_SIZE`` tokens).

Every injected fault logs one ``lmcache-ascend-faults:`` line.

Test support, also here:

* :func:`run_engine_process` runs an ``engine_run`` scenario in a fresh
  process (``python -m faults SCENARIO OUT``) like the
  integration fixture does, but never waits past its timeout, reports a
  process still alive ``exit_bound_s`` after writing its results as hung at
  exit, and returns the exit code and timings either way;
* :func:`reference_outputs`: no-connector completions of the shared prompt
  set (:func:`reliability_prompts`), one engine run per test process;
* :func:`request_transfers`: the worker's per-request summary lines, parsed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import engine_zygote

logger = logging.getLogger(__name__)

FAULTY_CONNECTOR = "FaultyLMCacheAscendConnectorV1Dynamic"
FAULTS_MODULE = "faults"
SUPPORT_DIR = Path(__file__).resolve().parent


# Test engines run vLLM's engine core in the engine's own process unless the
# test asks for the multiprocess one (VLLM_ENABLE_V1_MULTIPROCESSING=1, the
# default of `vllm serve` and of `LLM`): two fewer processes importing vLLM,
# torch and LMCache, about half of an engine run on a 2-core machine (25 s
# against 54 s for the same llama workload), and the steps of a batch do not
# follow process timing. The tests that cover the multiprocess engine core
# (the connector's halves in two processes, its metadata pickled between
# them) set it to 1; the OpenAI-server tests run it as users do.
ENGINE_CORE_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
MULTIPROCESS = {ENGINE_CORE_ENV: "1"}


def support_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a test engine process: this folder on PYTHONPATH, so
    vLLM's engine processes can import the faulty connector by its module
    path, and the engine core in-process unless ``env`` says otherwise."""
    paths = [str(SUPPORT_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {ENGINE_CORE_ENV: "0", **env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
FAULT_LOG_TAG = "lmcache-ascend-faults:"


class InjectedFault(RuntimeError):
    """Raised where a fault was injected on purpose."""


@dataclass(frozen=True)
class FailPlan:
    """Which calls fail: every one, the first ``first`` ones, or every ``every``-th."""

    all: bool = False
    first: int = 0
    every: int = 0

    @staticmethod
    def parse(text: Optional[str], name: str) -> Optional["FailPlan"]:
        if not text:
            return None
        text = text.strip().lower()
        if text == "all":
            return FailPlan(all=True)
        if text.startswith("every:"):
            k = int(text.split(":", 1)[1])
            if k < 1:
                raise ValueError(f"{name}={text!r}: every:K needs K >= 1")
            return FailPlan(every=k)
        if text.isdigit():
            return FailPlan(first=int(text))
        raise ValueError(f"{name}={text!r}: valid forms are all, N, every:K")

    def fails(self, call_number: int) -> bool:
        """``call_number`` is 1-based."""
        if self.all:
            return True
        if self.first:
            return call_number <= self.first
        if self.every:
            return call_number % self.every == 0
        return False


def parse_signals(text: Optional[str]) -> dict[int, list[int]]:
    """``"3:KILL"`` / ``"2:STOP,4:CONT"`` -> {request number: [signal, ...]}."""
    out: dict[int, list[int]] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        at, _, name = item.strip().partition(":")
        sig = getattr(signal, "SIG" + name.strip().upper(), None)
        if not at.strip().isdigit() or sig is None:
            raise ValueError(f"LMCA_FAULT_SIGNALS item {item!r}: expected N:SIGNAL, e.g. 3:KILL")
        out.setdefault(int(at), []).append(int(sig))
    return out


def parse_after_lookup(text: Optional[str]) -> dict[int, list[tuple[str, int]]]:
    """``"2:dropkeys:6379,3:kill:123"`` -> {request number: [(action, arg)]}."""
    out: dict[int, list[tuple[str, int]]] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        parts = item.strip().split(":")
        actions = ("dropkeys", "kill", "flipchunk", "waitport", "sleep")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in actions or not parts[2].isdigit():
            raise ValueError(
                f"LMCA_FAULT_AFTER_LOOKUP item {item!r}: expected N:ACTION:INT with ACTION one of {actions}"
            )
        out.setdefault(int(parts[0]), []).append((parts[1], int(parts[2])))
    return out


def chunk_hashes(tokens: list[int], chunk: int = 0) -> list[str]:
    """Hex chunk hashes exactly as LMCache names the chunks (sha256_cbor,
    the algorithm lmcache-ascend enforces), whole chunks only."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_ascend.lmcache_bridge.patching import lmcache_modules

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk or CHUNK, pre_caching_hash_algorithm="sha256_cbor", save_unfull_chunk=False
    )
    db = lmcache_modules.load(lmcache_modules.TOKEN_DATABASE).ChunkedTokenDatabase(cfg, None)
    out = []
    for _, _, h in db.process_tokens(torch.tensor(tokens), make_key=False):
        out.append(CacheEngineKey("m", 1, 0, h, torch.uint8).chunk_hash_hex)
    return out


def _resp(sock: Any, *args: bytes) -> bytes:
    sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
    buf = b""
    while True:  # enough for the short replies used here (KEYS of a few dozen keys)
        chunk = sock.recv(1 << 16)
        buf += chunk
        if not chunk or buf.endswith(b"\r\n"):
            return buf


def _after_lookup(action: str, arg: int, number: int, tokens: list[int]) -> None:
    if action == "kill":
        try:
            os.kill(arg, signal.SIGKILL)
        except ProcessLookupError:
            logger.warning("%s pid %d is gone", FAULT_LOG_TAG, arg)
            return
    elif action == "waitport":  # until something accepts connections on 127.0.0.1:arg (60 s at most)
        import socket

        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", arg), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing listened on 127.0.0.1:{arg} within 60 s") from None
                time.sleep(0.2)
    elif action == "sleep":
        time.sleep(arg)
    elif action == "flipchunk":
        disk = Path(os.environ["LMCACHE_LOCAL_DISK"].removeprefix("file://"))
        h = chunk_hashes(tokens, int(os.environ["LMCACHE_CHUNK_SIZE"]))[arg]
        files = [p for p in disk.rglob("*") if p.is_file() and f"@{h}@" in p.name]
        if len(files) != 1:
            raise RuntimeError(f"chunk {arg} of request {number}: expected one file in {disk}, found {files}")
        data = bytearray(files[0].read_bytes())
        for off in (17, len(data) // 3, len(data) // 2 + 5):
            data[off] ^= 0xFF
        files[0].write_bytes(bytes(data))
    else:
        import socket

        hashes = [f"@{h}@".encode() for h in chunk_hashes(tokens)]
        with socket.create_connection(("127.0.0.1", arg), timeout=10) as sock:
            keys = [k for k in _resp(sock, b"KEYS", b"*").split(b"\r\n") if any(h in k for h in hashes)]
            if not keys:
                raise RuntimeError(f"no keys of request {number} in the Redis on port {arg}")
            _resp(sock, b"DEL", *keys)
    logger.warning("%s %s %d around the lookup of request %d", FAULT_LOG_TAG, action, arg, number)


def _failing(fn: Callable, plan: FailPlan, what: str) -> Callable:
    lock = threading.Lock()
    count = {"calls": 0, "failed": 0}

    def wrapper(*args, **kwargs):
        with lock:
            count["calls"] += 1
            n = count["calls"]
        if plan.fails(n):
            with lock:
                count["failed"] += 1
            logger.warning("%s injected %s failure (call %d)", FAULT_LOG_TAG, what, n)
            raise InjectedFault(f"injected {what} failure (call {n})")
        return fn(*args, **kwargs)

    wrapper.counts = count  # type: ignore[attr-defined]
    return wrapper


def _hold_lookup(half: Any, spec: str) -> None:
    """``LMCA_FAULT_LOOKUP_DELAY=N:S``: the scheduler half's Nth call of its
    LMCache lookup (on whatever thread runs lookups) takes S seconds longer,
    as a slow remote fetch would."""
    number, seconds = spec.split(":")
    inner, calls = half._lookup, [0]

    def held(token_ids, lookup_id):
        calls[0] += 1
        if calls[0] == int(number):
            logger.warning("%s lookup %d (%s) held %s s on thread %s", FAULT_LOG_TAG, calls[0], lookup_id,
                           seconds, threading.current_thread().name)
            time.sleep(float(seconds))
        return inner(token_ids, lookup_id)

    if callable(getattr(inner, "close", None)):
        held.close = inner.close  # type: ignore[attr-defined]  # closed with the half, as before
    half._lookup = held


def _build_faulty_connector():
    from lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1 import (
        LMCacheAscendConnectorV1Dynamic,
    )

    class FaultyLMCacheAscendConnectorV1Dynamic(LMCacheAscendConnectorV1Dynamic):
        """The real connector with the faults named by ``LMCA_FAULT_*`` applied."""

        def __init__(self, vllm_config, role, kv_cache_config) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            self._fault_requests = 0
            # Requests whose lookup answered None (running beside the step): their number.
            self._deferred: dict[str, int] = {}
            pid = os.environ.get("LMCA_FAULT_PID")
            self._signal_pid = int(pid) if pid else None
            self._signals = parse_signals(os.environ.get("LMCA_FAULT_SIGNALS"))
            if self._signals and self._signal_pid is None:
                raise ValueError("LMCA_FAULT_SIGNALS needs LMCA_FAULT_PID")
            self._after_lookup = parse_after_lookup(os.environ.get("LMCA_FAULT_AFTER_LOOKUP"))
            self._before_lookup = parse_after_lookup(os.environ.get("LMCA_FAULT_BEFORE_LOOKUP"))
            delay = os.environ.get("LMCA_FAULT_LOOKUP_DELAY")
            if delay and getattr(self, "_scheduler", None) is not None:
                _hold_lookup(self._scheduler, delay)

        def register_kv_caches(self, kv_caches) -> None:
            super().register_kv_caches(kv_caches)
            gpu = self._worker.engine.engine.gpu_connector  # LMCache engine's PagedChunkConnector
            only = os.environ.get("LMCA_FAULT_RANK")
            if only is not None:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
                if rank != int(only):
                    logger.warning("%s copy faults not armed on TP rank %d (LMCA_FAULT_RANK=%s)",
                                   FAULT_LOG_TAG, rank, only)
                    return
            store = FailPlan.parse(os.environ.get("LMCA_FAULT_STORE_FAIL"), "LMCA_FAULT_STORE_FAIL")
            if store is not None:
                gpu._store = _failing(gpu._store, store, "store (KV -> chunk buffer)")
                logger.warning("%s store faults armed: %s", FAULT_LOG_TAG, store)
            load = FailPlan.parse(os.environ.get("LMCA_FAULT_LOAD_FAIL"), "LMCA_FAULT_LOAD_FAIL")
            if load is not None:
                gpu._load = _failing(gpu._load, load, "load (chunk buffer -> KV)")
                logger.warning("%s load faults armed: %s", FAULT_LOG_TAG, load)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            # A lookup running beside the step answers None ("ask again"):
            # the calls until its answer are one lookup, numbered once (its
            # signals and before-actions, popped on the first call, run once).
            number = self._deferred.pop(request.request_id, None)
            if number is None:
                self._fault_requests += 1
                number = self._fault_requests
            for sig in self._signals.pop(number, ()):
                try:
                    os.kill(self._signal_pid, sig)
                    logger.warning("%s sent %s to pid %d before request %d", FAULT_LOG_TAG,
                                   signal.Signals(sig).name, self._signal_pid, number)
                except ProcessLookupError:
                    logger.warning("%s pid %d is gone", FAULT_LOG_TAG, self._signal_pid)
            for action, arg in self._before_lookup.pop(number, ()):
                _after_lookup(action, arg, number, list(request.prompt_token_ids))
            result = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if result[0] is None:
                self._deferred[request.request_id] = number
                return result
            for action, arg in self._after_lookup.pop(number, ()):
                _after_lookup(action, arg, number, list(request.prompt_token_ids))
            return result

    return FaultyLMCacheAscendConnectorV1Dynamic


_lazy: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    # The connector class is built on first access (vLLM's connector factory
    # does getattr(module, name)), so importing this module needs no vLLM.
    if name == FAULTY_CONNECTOR:
        if name not in _lazy:
            _lazy[name] = _build_faulty_connector()
        return _lazy[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def faulty_transfer_config(kv_extra: Optional[dict[str, Any]] = None, kv_role: str = "kv_both") -> dict[str, Any]:
    """``kv_transfer_config`` selecting the faulty connector (pass it in a
    Scenario's ``engine_kwargs`` with ``connector="none"``)."""
    return {
        "kv_connector": FAULTY_CONNECTOR,
        "kv_connector_module_path": FAULTS_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": dict(kv_extra or {}),
    }


# ---- engine process runner -------------------------------------------------


@dataclass
class EngineProcess:
    returncode: Optional[int]  # None: killed (timeout or hung at exit)
    log: str
    results: Optional[list]  # engine_run.PhaseResult list, None when it failed
    seconds: float  # whole process
    last_phase_to_exit_s: Optional[float]  # start of the last phase -> process gone
    timed_out: bool  # killed at timeout_s
    hung_at_exit: bool  # results written, then still alive after exit_bound_s


def _driver(scenario_path: str, out_path: str) -> int:
    """Child side: engine_run.run with a timestamped progress line per phase."""
    from lmcache_ascend.cli.engine_run import Scenario, run

    with open(scenario_path) as f:
        scenario = Scenario.from_json(json.load(f))

    def progress(msg: str) -> None:
        print(f"LMCA_PROGRESS {time.time():.3f} {msg}", flush=True)

    results = run(scenario, progress=progress)
    with open(out_path, "w") as f:
        json.dump([asdict(r) for r in results], f)
    print(f"LMCA_PROGRESS {time.time():.3f} results written", flush=True)
    return 0


def run_engine_process(
    scenario: Any,
    workdir: Path,
    tag: str,
    env: Optional[dict[str, str]] = None,
    timeout_s: float = 300.0,
    exit_bound_s: float = 60.0,
) -> EngineProcess:
    """Run ``scenario`` (an ``engine_run.Scenario``) in a fresh process.

    Never raises on a failed engine (the caller asserts on the result) and
    never waits past ``timeout_s``, nor more than ``exit_bound_s`` after the
    results were written: a process still alive then is hung at exit; it is
    killed (its whole session) and reported with ``hung_at_exit=True`` (its
    results are still returned).
    """
    from lmcache_ascend.cli.engine_run import Completion, PhaseResult

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sc = workdir / f"{tag}.scenario.json"
    out = workdir / f"{tag}.out.json"
    log_path = workdir / f"{tag}.log"
    out.unlink(missing_ok=True)
    sc.write_text(json.dumps(asdict(scenario)))
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(scenario.kv_cache_gib))
    full_env.setdefault("LMCACHE_LOG_LEVEL", "INFO")
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    full_env.update(env or {})
    full_env = support_env(full_env)
    t0 = time.time()
    timed_out = hung = False
    results_at: Optional[float] = None
    full_env.update(scenario.env)  # set before vLLM is imported (engine_run)
    proc = engine_zygote.pool().launch(FAULTS_MODULE, [str(sc), str(out)], full_env, workdir,
                                       log_path, owner=str(workdir), new_session=True)
    if proc is None:
        with open(log_path, "w") as lf:
            proc = subprocess.Popen(
                [sys.executable, "-m", FAULTS_MODULE, str(sc), str(out)],
                stdout=lf,
                stderr=subprocess.STDOUT,
                cwd=str(workdir),
                env=full_env,
                start_new_session=True,
            )
    while proc.poll() is None:
        now = time.time()
        if results_at is None and out.exists():
            results_at = now
        if now - t0 > timeout_s:
            timed_out = True
        elif results_at is not None and now - results_at > exit_bound_s:
            hung = True
        if timed_out or hung:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
            break
        time.sleep(0.25)
    t_exit = time.time()
    text = log_path.read_text(errors="replace")
    last_phase = None
    for line in text.splitlines():
        if line.startswith("LMCA_PROGRESS ") and " phase " in line:
            last_phase = float(line.split()[1])
    results = None
    if out.exists() and (proc.returncode == 0 or hung):
        raw = json.loads(out.read_text())
        results = [
            PhaseResult.from_json(r)
            for r in raw
        ]
    return EngineProcess(
        returncode=None if (timed_out or hung) else proc.returncode,
        log=text,
        results=results,
        seconds=t_exit - t0,
        last_phase_to_exit_s=(t_exit - last_phase) if last_phase is not None else None,
        timed_out=timed_out,
        hung_at_exit=hung,
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(f"usage: python -m {FAULTS_MODULE} SCENARIO.json OUT.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(_driver(sys.argv[1], sys.argv[2]))


# ---- shared workload and no-connector reference ------------------------------

CHUNK = 256
LOGPROB_TOL = 1e-3


def reliability_prompts() -> dict[str, list[int]]:
    """The prompts every reliability test draws from, by name, so one
    no-connector reference run serves them all.

    ``S0``..``S5``: 3 whole chunks + 60 tokens (sharing, damaged entries);
    ``E0``..``E11``: 2 whole chunks + 20 tokens (eviction, store faults,
    outages).
    """
    from lmcache_ascend.cli.tiny_models import token_prompt

    out = {f"S{i}": token_prompt(3 * CHUNK + 60, seed=100 + i) for i in range(6)}
    out.update({f"E{i}": token_prompt(2 * CHUNK + 20, seed=300 + i) for i in range(12)})
    return out


_REFERENCE: dict[tuple, dict[str, Any]] = {}


def reference_outputs(model: str, workdir: Path, max_tokens: int = 8) -> dict[str, Any]:
    """No-connector completions of every :func:`reliability_prompts` prompt
    (name -> ``Completion``), from one sequential engine run per process."""
    from lmcache_ascend.cli.engine_run import Phase, Scenario

    key = (model, max_tokens)
    if key not in _REFERENCE:
        prompts = reliability_prompts()
        names = sorted(prompts)
        scenario = Scenario(
            model=model,
            connector="none",
            phases=[Phase("reference", [prompts[n] for n in names], max_tokens, sequential=True)],
        )
        run = run_engine_process(scenario, workdir, "reference", timeout_s=600)
        if run.results is None:
            raise AssertionError(
                "reference (no-connector) run failed:\n" + "\n".join(run.log.splitlines()[-40:])
            )
        _REFERENCE[key] = dict(zip(names, run.results[0].completions))
    return _REFERENCE[key]


def mismatch(got: Any, ref: Any, tol: float = LOGPROB_TOL) -> Optional[str]:
    """None when two completions agree (tokens equal, logprobs within
    ``tol``), else a description of the difference."""
    if got.tokens != ref.tokens:
        return f"tokens {got.tokens} != {ref.tokens}"
    if len(got.logprobs) != len(ref.logprobs):
        return f"{len(got.logprobs)} logprobs != {len(ref.logprobs)}"
    worst = max((abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)), default=0.0)
    if worst > tol:
        return f"logprobs differ by {worst:.3g} (> {tol})"
    return None


@dataclass(frozen=True)
class RequestSummary:
    """One ``lmcache-ascend: request N-...: hit ...`` summary line of the worker."""

    hit: int
    vllm_had: int
    loaded: int
    stored: int
    load_error: bool


_REQUEST_LINE = re.compile(
    r"lmcache-ascend: request (\d+)-\S+: hit (\d+) tokens \(vLLM had (\d+)\), "
    r"loaded (\d+) tokens.*?(\(load error[^)]*\))?, stored (\d+) tokens"
)


def request_transfers(log: str) -> dict[int, RequestSummary]:
    """Per-request transfer summaries from an engine log, by the request's
    submission number (vLLM's offline ``LLM`` numbers requests 0, 1, ...)."""
    out: dict[int, RequestSummary] = {}
    for m in _REQUEST_LINE.finditer(log):
        n, hit, had, loaded, err, stored = m.groups()
        out[int(n)] = RequestSummary(int(hit), int(had), int(loaded), int(stored), err is not None)
    return out


def request_warnings(log: str, number: int) -> list[str]:
    """``lmcache-ascend`` warning lines about request ``number``."""
    tag = f"lmcache-ascend: request {number}-"
    return [line for line in log.splitlines() if tag in line and "WARNING" in line]
