# SPDX-License-Identifier: Apache-2.0
"""A remote hit while other requests decode: their gaps, its TTFT, one run.

What a user of a shared pool sees (issue: transfers off the critical path):
requests decode on an instance while another request arrives with a long
prefix that only the pool (a real redis-server on 127.0.0.1, LMCache's
remote backend) holds. Measured, against two controls on the same server:

  remote   the prefix is in Redis only (written by another instance), not in
           this instance's vLLM or LMCache CPU cache: the connector looks it
           up, fetches and verifies it, and loads it;
  vllm     the same kind of prompt hitting in vLLM's own prefix cache (sent
           once before): the no-transfer limit;
  cold     a prompt nobody has seen: a full prefill (chunked by vLLM).

and, with nothing decoding (what the fetch itself costs where the CPU is
not shared with the model's compute, as on an NPU host):

  remote-idle  another prompt held in Redis only;
  vllm-idle    the vLLM-hit prompt once more.

Two OpenAI servers with the connector run one after the other: the writer
computes every "remote" prompt once (its stores reach Redis) and stops;
the reader starts with empty caches and serves the three kinds while one
request decodes. For each arriving request: its TTFT, and the largest and
p99 gap between the decoding request's tokens while it was in flight. Also,
in the same run: a plain client reading the pool one value at a time (what
fetching the same bytes costs without the connector; redis-py with its
pure-Python parser and, where installed, hiredis's; for Mooncake its own
Python client, into its buffer and into a registered one of the
client's), on the idle machine and beside a decoding request (as the
remote hits ran), against the connector's effective rate (the remote hit's
KV bytes over its TTFT minus the vLLM hit's). Each server's log says, per
lookup that read the pool, its bytes, wall time, read time and check time. Outputs of every remote hit equal the writer's cold ones
(greedy tokens; logprobs within 1e-3) or the run says so.

The model is a random-weight Llama with 16 KiB of KV per token (float32; 8
layers x 4 KV heads x 64), so a fetch of a few thousand tokens takes longer
than a decode step on this kind of machine.

Goals (issue 36), printed as ratios measured here: largest decode gap
during a remote hit <= 1.2x the gap during a vLLM hit; remote TTFT <= the
fetch time plus one step; fetch rate >= 0.7x the plain client's. The fetch
rate (the remote hit's KV bytes over its TTFT minus the vLLM hit's) is
printed beside a decode and with nothing decoding, each against the plain
client reading as many bytes right after it under the same conditions (the
goal, like with like: the median of the per-repeat ratios, with their
range), and against the plain client's best pass once the reader has
stopped (a quieter machine than any hit had). On vLLM-CPU the decode's
threads take the cores the reads need.

The pool (``--scheme``): Redis through LMCache's redis:// connector
(the default; the staged lookups read its entries on redis-py's synchronous
client, or with ``--lmcache-reads`` through LMCache's asyncio connector) or
its resp:// one (its native client), or Mooncake (a master and a segment
holder on 127.0.0.1, TCP).

Usage:
  python bench/bench_remote_hit.py [--lengths 4096,8192,12288] [--repeats 3]
      [--scheme redis|resp|mooncake] [--lmcache-reads] [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from serving_client import HOST, Server, ServerSpec, complete  # noqa: E402

from lmcache_ascend.cli.tiny_models import TinyModelSpec, build_tiny_model, token_prompt  # noqa: E402
from redis_server import RedisServer, ensure_redis_server  # noqa: E402

# Positions up to 64k: the prompts reach 32k tokens (the tiny
# models' default is 16k).
MODEL = TinyModelSpec("llama", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=64,
                      intermediate_size=512, extra=(("max_position_embeddings", 65536),))
KV_BYTES_PER_TOKEN = MODEL.num_layers * 2 * MODEL.num_kv_heads * MODEL.head_dim * 4
# vLLM-CPU's block: the connector then hits where vLLM's own cache does, so
# the step after a hit computes the same tokens in every kind.
CHUNK = 128
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600


class Decoder:
    """One request decoding in the background; its token arrival times."""

    def __init__(self, port: int, model: str, seed: int) -> None:
        self.stamps: list[float] = []
        self._stop = threading.Event()
        self._conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
        body = json.dumps({"model": model, "prompt": token_prompt(64, seed=seed), "max_tokens": 4000,
                           "temperature": 0, "ignore_eos": True, "stream": True})
        self._conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for raw in self._conn.getresponse():
                if self._stop.is_set():
                    break
                if raw.startswith(b"data: {"):
                    self.stamps.append(time.perf_counter())
        except (OSError, AttributeError, ValueError):
            pass  # stop() closed the stream under the reader

    def wait_steady(self, tokens: int = 20, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.stamps) < tokens:
            if time.monotonic() > deadline:
                raise TimeoutError("the decoding request produced no steady stream")
            time.sleep(0.05)

    def stop(self) -> None:
        # Closing the stream aborts the request in vLLM.
        self._stop.set()
        self._conn.close()
        self._thread.join(30)

    def gaps(self, start: float, end: float) -> list[float]:
        s = self.stamps
        return [b - a for a, b in zip(s, s[1:]) if b > start and a < end]


@dataclass
class Arrival:
    kind: str  # remote | vllm | cold
    length: int
    repeat: int
    ttft_s: float
    cached_tokens: int
    max_gap_ms: float
    p99_gap_ms: float
    median_gap_ms: float  # of the decoder before the arrival: its steady pace
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # The plain client's GB/s reading as many bytes right after this
    # arrival, under the same conditions (beside the same decode, or with
    # nothing decoding): remote kinds only, else nan.
    plain_gbs: float = float("nan")


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def arrive(port: int, model: str, kind: str, prompt: list[int], length: int, repeat: int,
           plain: Optional[Callable[[int], float]] = None) -> Arrival:
    """One request of ``kind``; with ``plain``, the plain client then reads
    as many bytes as it hit (``plain(nbytes)`` -> GB/s) before anything
    changes: beside the same decode, or with nothing decoding."""
    nan = float("nan")
    if kind.endswith("-idle"):  # nothing decodes: no gaps to report
        time.sleep(0.5)
        reply = complete(port, model, prompt, max_tokens=4, timeout=REQUEST_TIMEOUT_S)
        rate = plain(reply.cached_tokens * KV_BYTES_PER_TOKEN) if plain else nan
        return Arrival(kind, length, repeat, reply.ttft, reply.cached_tokens, nan, nan, nan, reply.tokens,
                       reply.logprobs, rate)
    dec = Decoder(port, model, seed=90_000 + 7 * length + 100 * repeat + len(kind))
    try:
        dec.wait_steady()
        time.sleep(0.5)
        before = dec.gaps(0.0, time.perf_counter())
        t0 = time.perf_counter()
        reply = complete(port, model, prompt, max_tokens=4, timeout=REQUEST_TIMEOUT_S)
        t1 = t0 + reply.ttft
        time.sleep(0.3)  # the decoder's gap that ends after the first token
        during = dec.gaps(t0, t1) or [nan]
        rate = plain(reply.cached_tokens * KV_BYTES_PER_TOKEN) if plain else nan
    finally:
        dec.stop()
    return Arrival(kind, length, repeat, reply.ttft, reply.cached_tokens, max(during) * 1e3, p99(during) * 1e3,
                   statistics.median(before[-50:]) * 1e3, reply.tokens, reply.logprobs, rate)


def _settle(count, quiet_s: float = 3.0, timeout: float = 300.0) -> int:
    """Waits until ``count()`` (values in the pool) stopped growing: the
    writer's puts are asynchronous, and a server stopped with vLLM's default
    (abort) shutdown would lose those in flight."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.25)
    return last


def _value_keys(client) -> list[bytes]:
    """The pool's KV values: LMCache's redis:// connector writes a
    ``...kv_bytes`` and a ``...metadata`` key per chunk, resp:// one key."""
    keys = client.keys()
    if any(k.endswith(b"metadata") for k in keys):
        return [k for k in keys if k.endswith(b"kv_bytes")]
    return list(keys)


class RedisPool:
    """A redis-server read through LMCache's redis:// or resp:// connector."""

    def __init__(self, work: Path, scheme: str, lmcache_reads: bool = False) -> None:
        self._server = RedisServer(work / "redis")
        self._scheme = scheme
        self._lmcache_reads = lmcache_reads
        # The paired plain client (paired_rate): its connection, the values
        # it reads, and the next one.
        self._plain_client = None
        self._plain_keys: list[bytes] = []
        self._plain_next = 0

    def __enter__(self) -> "RedisPool":
        self._server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._plain_client is not None:
            self._plain_client.close()
        self._server.__exit__(*exc)

    def env(self) -> dict[str, str]:
        url = self._server.url.replace("redis://", f"{self._scheme}://", 1)
        env = {"LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive"}
        if self._lmcache_reads:  # redis://: the staged lookups read through LMCache's asyncio connector
            env["LMCACHE_ASCEND_REDIS_SYNC_READS"] = "false"
        return env

    def settle(self) -> int:
        import redis

        client = redis.Redis.from_url(self._server.url)
        try:
            return _settle(lambda: len(_value_keys(client)))
        finally:
            client.close()

    def paired_rate(self, nbytes: int) -> float:
        """GB/s of one pass of the fastest plain client (redis-py GETs, one
        at a time, hiredis's parser where installed) over about ``nbytes``
        of the pool's values, now. Run right after each remote hit, it reads
        as many bytes from the same server under the same conditions (beside
        the same decode, or the server idle with its worker's loop still
        spinning from the request), so the two rates are paired like with
        like. Each pass reads the next values in turn, as each hit reads
        another prompt's."""
        import redis

        if self._plain_client is None:
            try:
                import hiredis  # noqa: F401
                from redis.connection import _HiredisParser as parser
            except ImportError:
                from redis.connection import _RESP2Parser as parser
            self._plain_client = redis.Redis.from_url(self._server.url, parser_class=parser)
            self._plain_keys = _value_keys(self._plain_client)
        total, t0 = 0, time.perf_counter()
        while total < nbytes:
            total += len(self._plain_client.get(self._plain_keys[self._plain_next % len(self._plain_keys)]) or b"")
            self._plain_next += 1
        return total / (time.perf_counter() - t0) / 1e9

    def plain_rates(self) -> tuple[dict[str, float], int]:
        """GB/s of redis-py GETs, one at a time, of every value in the pool,
        per reply parser redis-py has here (its pure-Python one, and
        hiredis's C parser where the ``hiredis`` package is installed: about
        7x faster on 2 MiB values), and the bytes read. The fastest parser
        reads the pool three times and its best pass counts: one pass swung
        from 0.6 to 2.7 GB/s between runs here (a server just stopped
        beside it still returning its memory), and the goal is measured
        against what the plain client can do."""
        import redis
        from redis.connection import _RESP2Parser

        parsers = {"python": _RESP2Parser}
        try:
            import hiredis  # noqa: F401
            from redis.connection import _HiredisParser

            parsers["hiredis"] = _HiredisParser
        except ImportError:
            pass
        rates, total = {}, 0
        for name, parser in parsers.items():
            client = redis.Redis.from_url(self._server.url, parser_class=parser)
            keys = _value_keys(client)
            best = 0.0
            for _ in range(3 if name == list(parsers)[-1] else 1):
                t0 = time.perf_counter()
                total = sum(len(client.get(k) or b"") for k in keys)
                best = max(best, total / (time.perf_counter() - t0) / 1e9)
            client.close()
            rates[name] = best
        return rates, total


class MooncakePool:
    """A Mooncake master and segment holder on 127.0.0.1 (TCP), read through
    LMCache's mooncakestore:// connector."""

    def __init__(self, work: Path, pool_bytes: int, chunk_meta: bool = False) -> None:
        from mooncake_server import MooncakeStore

        # chunk_meta: LMCache's own format (save_chunk_meta on), each value
        # read into Mooncake's buffer and copied out, instead of the
        # connector's default (off: batch_get_into LMCache's buffers).
        self._overrides = {"save_chunk_meta": True} if chunk_meta else {}

        # Room for what the writer stores, what the reader stores (its cold
        # and vLLM-hit prompts are as long), and the plain client's values.
        self._store = MooncakeStore(work / "mooncake", segment=f"{max(2, -(-4 * pool_bytes // (1 << 30)))}GB")

    def __enter__(self) -> "MooncakePool":
        self._store.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._store.__exit__(*exc)

    def env(self) -> dict[str, str]:
        return self._store.engine_env(**self._overrides)

    def _key_count(self) -> int:
        import urllib.request

        url = f"http://127.0.0.1:{self._store.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return next(int(float(line.split()[1])) for line in text.splitlines() if line.startswith("master_key_count "))

    def settle(self) -> int:
        return _settle(self._key_count)

    def paired_rate(self, nbytes: int) -> float:
        """Not measured for Mooncake (nan): it lists no keys, so its plain
        client reads values it put itself (``plain_rates``), and putting
        them while the reader runs would change the pool under it."""
        return float("nan")

    def plain_rates(self) -> tuple[dict[str, float], int]:
        """GB/s of a plain Mooncake client (``MooncakeDistributedStore``,
        one value at a time) reading values of the pool's value size (up to
        128 of them): Mooncake lists no keys, so it reads values it put
        itself, of the same size, from the same store. Two ways: into
        Mooncake's buffer (``get_buffer``) and into a registered buffer of
        the client's (``get_into``, what the zero-copy mode does)."""
        import numpy as np
        from mooncake.store import MooncakeDistributedStore

        n = min(128, self._key_count())
        size = CHUNK * KV_BYTES_PER_TOKEN
        store = MooncakeDistributedStore()
        setup = {k[len("mooncake_"):]: str(v) for k, v in
                 self._store.extra_config(mooncake_local_buffer_size=256 << 20).items()}
        assert store.setup(setup) == 0, "Mooncake setup failed"
        value = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
        keys = [f"plain-{i}" for i in range(n)]
        for key in keys:
            assert store.put(key, value) == 0, "Mooncake put failed"
        t0 = time.perf_counter()
        total = 0
        for key in keys:
            buf = store.get_buffer(key)
            total += len(memoryview(buf))
        took = time.perf_counter() - t0
        into = np.empty(size, dtype=np.uint8)
        ptr = into.ctypes.data
        assert store.register_buffer(ptr, size) == 0, "Mooncake register_buffer failed"
        t1 = time.perf_counter()
        for key in keys:
            assert store.get_into(key, ptr, size) == size, "Mooncake get_into failed"
        took_into = time.perf_counter() - t1
        store.unregister_buffer(ptr)
        for key in keys:
            store.remove(key)
        store.close()
        return {"mooncake get_buffer": total / took / 1e9, "mooncake get_into": total / took_into / 1e9}, total


def paired_ratios(arrivals: list[Arrival], length: int, kind: str, control: str) -> list[float]:
    """Per repeat: the fetch rate of the ``kind`` remote hit (its KV bytes
    over its TTFT minus the same repeat's ``control`` vLLM hit's) over the
    plain client's rate right after it."""
    out = []
    for a in arrivals:
        if a.length == length and a.kind == kind:
            vhit = next(b for b in arrivals if b.length == length and b.repeat == a.repeat and b.kind == control)
            fetch_s = a.ttft_s - vhit.ttft_s
            rate = a.cached_tokens * KV_BYTES_PER_TOKEN / 1e9 / fetch_s if fetch_s > 0 else float("inf")
            out.append(rate / a.plain_gbs)
    return out


def med_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "-"


def plain_passes(arrivals: list[Arrival], length: int, kind: str) -> str:
    return ", ".join(f"{a.plain_gbs:.2f}" for a in arrivals if a.length == length and a.kind == kind)


def remote_prompts_bytes(prompts: dict) -> list[int]:
    """KV bytes of each prompt's whole chunks (what the writer stores)."""
    return [len(p) // CHUNK * CHUNK * KV_BYTES_PER_TOKEN for p in prompts.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192,12288", help="prompt tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=3,
                    help="arrivals of each kind per length (the goals are medians over them; one is noisy here)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--scheme", choices=("redis", "resp", "mooncake"), default="redis",
                    help="the pool: Redis through LMCache's redis:// (redis-py asyncio) or resp:// (its "
                         "native client) connector, or Mooncake (mooncakestore://, TCP on 127.0.0.1)")
    ap.add_argument("--save-chunk-meta", action="store_true",
                    help="Mooncake values in LMCache's own format (save_chunk_meta: true; read into Mooncake's "
                         "buffer, then copied) instead of the connector's default (read into LMCache's buffers)")
    ap.add_argument("--lmcache-reads", action="store_true",
                    help="redis://: staged lookups read through LMCache's asyncio connector instead of the "
                         "connector's synchronous redis-py reads (ascend_redis_sync_reads: false)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep server logs here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if ensure_redis_server() is None:
        print("redis-server is not installed", file=sys.stderr)
        return 2
    model = str(build_tiny_model(MODEL))
    max_len = max(lengths) + 64
    # KV for one repeat's prompts (the cold/vLLM-hit one, both remote ones,
    # per length) and the decoder, with room to spare: each repeat's
    # prompts are new, so vLLM's and LMCache's caches evict earlier repeats'
    # (sized for every repeat at once, two lengths of 32k at three repeats
    # took more memory than a 24 GB machine has).
    kv_gib = max(1, -(-(4 * sum(lengths) * KV_BYTES_PER_TOKEN) // (1 << 30)) + 1)
    lmcache_gb = max(2.0, 3 * sum(lengths) * KV_BYTES_PER_TOKEN / 1e9)
    spec = ServerSpec(model, "ascend", max_len, kv_space_gib=kv_gib, lmcache_cpu_gb=lmcache_gb, chunk_size=CHUNK)
    # (length, repeat, kind): the prompts only the pool holds.
    remote_prompts = {(n, r, kind): token_prompt(n, seed=1000 * r + n + (500 if kind == "remote-idle" else 0))
                      for n in lengths for r in range(args.repeats) for kind in ("remote", "remote-idle")}
    arrivals: list[Arrival] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        pool_bytes = sum(remote_prompts_bytes(remote_prompts))
        pool = MooncakePool(work, pool_bytes, args.save_chunk_meta) if args.scheme == "mooncake" else RedisPool(work, args.scheme, args.lmcache_reads)
        with pool:
            os.environ.update(pool.env())
            log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
            writer = Server(spec, work / "writer.log")
            try:
                writer.wait_ready(START_TIMEOUT_S, log, "writer")
                reference = {key: complete(writer.port, model, p, 4, REQUEST_TIMEOUT_S)
                             for key, p in remote_prompts.items()}
                log(f"writer: {pool.settle()} chunks in the pool")
            finally:
                writer.stop()
            reader = Server(spec, work / "reader.log")
            try:
                reader.wait_ready(START_TIMEOUT_S, log, "reader")
                complete(reader.port, model, token_prompt(300, seed=7), 4, REQUEST_TIMEOUT_S)  # first-request costs
                for r in range(args.repeats):
                    for n in lengths:
                        other = token_prompt(n, seed=500_000 + 1000 * r + n)
                        log(f"length {n}, repeat {r}")
                        arrivals.append(arrive(reader.port, model, "cold", other, n, r))
                        arrivals.append(arrive(reader.port, model, "vllm", other, n, r))
                        # After each remote hit the plain client reads as many
                        # bytes under the same conditions: the pair the goal
                        # compares, like with like.
                        arrivals.append(arrive(reader.port, model, "remote", remote_prompts[(n, r, "remote")], n, r,
                                               pool.paired_rate))
                        arrivals.append(arrive(reader.port, model, "vllm-idle", other, n, r))
                        arrivals.append(arrive(reader.port, model, "remote-idle", remote_prompts[(n, r, "remote-idle")],
                                               n, r, pool.paired_rate))
                # Like with like: the plain client also reads while a request
                # decodes on this machine, as every remote hit above did.
                dec = Decoder(reader.port, model, seed=77)
                try:
                    dec.wait_steady()
                    beside, _ = pool.plain_rates()
                finally:
                    dec.stop()
            finally:
                reader.stop()
            rates, pool_bytes = pool.plain_rates()
    # The goal's reference: the fastest plain client this machine has, on
    # an idle machine and beside a decode.
    rate_gbs, beside_gbs = max(rates.values()), max(beside.values())

    exact = []
    for a in arrivals:
        if a.kind.startswith("remote"):
            ref = reference[(a.length, a.repeat, a.kind)]
            exact.append(a.tokens == ref.tokens and max(abs(x - y) for x, y in zip(a.logprobs, ref.logprobs)) <= 1e-3)
    print(f"model: llama, {MODEL.num_layers} layers, {KV_BYTES_PER_TOKEN // 1024} KiB of KV per token; "
          f"chunk {CHUNK}; medians over {args.repeats} repeat(s)")
    print("| prompt tokens | kind | TTFT s | tokens cached | largest decode gap ms | p99 gap ms | steady gap ms |")
    print("|---|---|---|---|---|---|---|")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    summary = {}
    for n in lengths:
        for kind in ("cold", "vllm", "remote", "vllm-idle", "remote-idle"):
            rows = [a for a in arrivals if a.length == n and a.kind == kind]
            cell = {k: med([getattr(a, k) for a in rows]) for k in
                    ("ttft_s", "cached_tokens", "max_gap_ms", "p99_gap_ms", "median_gap_ms")}
            summary[(n, kind)] = cell
            print(f"| {n} | {kind} | {cell['ttft_s']:.2f} | {cell['cached_tokens']:.0f} | {cell['max_gap_ms']:.0f} | "
                  f"{cell['p99_gap_ms']:.0f} | {cell['median_gap_ms']:.0f} |")
    print()
    print("| prompt tokens | gap remote / vLLM hit (goal <= 1.2) | fetch GB/s | / plain client's best pass, idle "
          "| / its best pass beside a decode | / plain client right after, beside the same decode (goal >= 0.7): "
          "median [range] |")
    print("|---|---|---|---|---|---|")
    for n in lengths:
        remote, vhit = summary[(n, "remote")], summary[(n, "vllm")]
        fetch_s = remote["ttft_s"] - vhit["ttft_s"]
        fetched = remote["cached_tokens"] * KV_BYTES_PER_TOKEN / 1e9
        rate = fetched / fetch_s if fetch_s > 0 else float("inf")
        print(f"| {n} | {remote['max_gap_ms'] / vhit['max_gap_ms']:.2f} | {rate:.2f} | {rate / rate_gbs:.2f} | "
              f"{rate / beside_gbs:.2f} | {med_range(paired_ratios(arrivals, n, 'remote', 'vllm'))} |")
    print()
    print("Nothing decoding (the fetch where the CPU is not shared with the model's compute):")
    print("| prompt tokens | TTFT vLLM hit / remote hit s | fetch GB/s | / plain client's best pass | "
          "/ plain client at the same moment (goal >= 0.7): median [range] |")
    print("|---|---|---|---|---|")
    for n in lengths:
        remote, vhit = summary[(n, "remote-idle")], summary[(n, "vllm-idle")]
        fetch_s = remote["ttft_s"] - vhit["ttft_s"]
        rate = remote["cached_tokens"] * KV_BYTES_PER_TOKEN / 1e9 / fetch_s if fetch_s > 0 else float("inf")
        print(f"| {n} | {vhit['ttft_s']:.2f} / {remote['ttft_s']:.2f} | {rate:.2f} | {rate / rate_gbs:.2f} | "
              f"{med_range(paired_ratios(arrivals, n, 'remote-idle', 'vllm-idle'))} |")
    print("plain client right after each remote hit, GB/s per repeat: "
          + "; ".join(f"{n}: {plain_passes(arrivals, n, 'remote')} beside the decode, "
                      f"{plain_passes(arrivals, n, 'remote-idle')} idle" for n in lengths))
    print(f"plain client reading {pool_bytes / 1e6:.0f} MB, one value at a time (the fastest parser: best of 3 passes): "
          + ", ".join(f"{rate:.2f} GB/s ({name})" for name, rate in rates.items()) + " idle; "
          + ", ".join(f"{rate:.2f} GB/s ({name})" for name, rate in beside.items()) + " beside a decode"
          + ("" if args.scheme == "mooncake" or "hiredis" in rates else
             "; hiredis is not installed, so the reference is redis-py's pure-Python parser "
             "(pip install hiredis for the C parser's)"))
    print(f"remote hits equal to the writer's cold outputs: {sum(exact)}/{len(exact)}")
    if args.json:
        args.json.write_text(json.dumps({"arrivals": [asdict(a) for a in arrivals], "plain_gbs": rates, "plain_beside_decode_gbs": beside,
                                         "scheme": args.scheme,
                                         "exact": exact}, indent=1))
    return 0 if all(exact) else 1


if __name__ == "__main__":
    sys.exit(main())
