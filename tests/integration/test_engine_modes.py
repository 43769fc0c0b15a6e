"""Entry routes, engine modes, storage backends and preemption on a real
vLLM engine (CPU), each compared against a run without the connector."""

from __future__ import annotations

import re

import pytest

from lmcache_ascend.cli.engine_run import Phase, Scenario
from lmcache_ascend.cli.tiny_models import token_prompt

from engine_checks import CHUNK, assert_same, one_core_per_rank

pytestmark = pytest.mark.engine


@pytest.mark.compat  # in-process engines must exit on every supported vLLM
def test_plugin_route_in_process_engine_local_disk(run_engine, tiny_model, tmp_path):
    """Connector resolved by name through the vllm.general_plugins entry point
    (no kv_connector_module_path), engine core in-process, chunks written to
    LMCache's local disk backend with a CPU cache too small to hold them all,
    so warm hits are served (at least partly) from disk."""
    model = tiny_model("gemma2")
    prompt = token_prompt(5 * CHUNK + 10, seed=11)
    phases = [
        Phase("cold", [prompt], sequential=True),
        Phase("warm", [prompt], reset_prefix_cache=True, sequential=True),
    ]
    disk = tmp_path / "disk"
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "LMCACHE_LOCAL_DISK": f"file://{disk}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "1",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.002",
        # The 2 MB CPU cache is sized against 256-token chunks: it holds a
        # few chunks in flight to disk, never the whole prompt.
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
    }
    got, log = run_engine(Scenario(model=model, phases=phases, connector="ascend-plugin", env=env))
    ref, _ = run_engine(Scenario(model=model, phases=phases, connector="none"))
    for g, r in zip(got, ref):
        assert_same(g, r, g.name)
    assert got[1].completions[0].num_cached_tokens == 5 * CHUNK
    files = list(disk.glob("*.pt"))
    assert len(files) >= 5, files  # every stored chunk reached the disk
    assert "LMCacheAscendConnectorV1Dynamic" in log
    # Disk chunks carry checksums; none failed.
    assert "checksum" not in log.lower() or "!= stored" not in log


@pytest.mark.redis
def test_preemption_under_small_kv_space(run_engine, tiny_model, tmp_path):
    """A batch that does not fit vLLM's KV blocks, on Gemma-3 (six groups)
    with Redis beside LMCache's CPU cache: requests are preempted and resumed
    (their blocks replaced) while the remote puts of earlier steps are still
    in flight beside the step. Outputs still equal a no-connector run, and
    the connector's close finds nothing held: no staged chunk, no chunk of
    LMCache's CPU cache pinned or referenced beyond the cache's own."""
    from redis_entries import redis_engine_env
    from redis_server import RedisServer, ensure_redis_server

    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("gemma3")
    shared = token_prompt(CHUNK, seed=21)
    prompts = [shared + token_prompt(60, seed=30 + i) for i in range(4)]
    phases = [
        Phase("warmup", [prompts[0]], sequential=True, max_tokens=4),
        # Long decodes grow every request's blocks until some are preempted.
        Phase("batch", prompts, reset_prefix_cache=True, max_tokens=180),
    ]
    kw = dict(max_model_len=512, engine_kwargs={"num_gpu_blocks_override": 40, "max_num_seqs": 4})
    with RedisServer(tmp_path) as redis:
        env = redis_engine_env(redis.url)
        got, log = run_engine(Scenario(model=model, phases=phases, env=env, **kw))
        with redis.client() as c:
            in_redis = c.dbsize()
    ref, ref_log = run_engine(Scenario(model=model, phases=phases, connector="none", **kw))
    for g, r in zip(got, ref):
        assert_same(g, r, g.name)
    # The shared prefix stored by the warmup request is hit in the batch.
    assert got[1].completions[0].num_cached_tokens >= CHUNK
    assert got[1].preemptions > 0, "no preemption happened"
    assert in_redis >= 2, "nothing reached Redis"  # two keys per chunk
    assert "lmcache-ascend: closing: 0 staged chunk(s) still held" in log, log[-3000:]
    assert re.search(r"lmcache-ascend: closing: 0 of \d+ chunk\(s\) in LMCache's CPU cache still pinned", log), \
        log[-3000:]


@pytest.mark.redis
def test_mla_preemption_resumes_from_loaded_chunks(tiny_model, tmp_path):
    """MLA (DeepSeek-V2-like, bf16: the only MLA vLLM-CPU runs) under
    preemption, with Redis beside LMCache's CPU cache: decodes grow four
    requests past 48 blocks of 16 tokens, vLLM preempts, and each preempted
    request resumes from chunks the connector stored (its prompt's and those
    its decodes filled), where vLLM-CPU, which runs MLA without its own
    prefix caching, recomputes the whole request.

    The reference is the same engine without the connector: both admit and
    preempt alike until the first resume, where the connector loads and
    vLLM recomputes (bf16 KV computed by decodes is not bit-equal to KV a
    prefill recomputes). What must hold: engine_checks.check_preempted_resumes."""
    from engine_checks import check_preempted_resumes
    from redis_server import RedisServer, ensure_redis_server

    from .conftest import run_engine_in

    if ensure_redis_server() is None:
        pytest.skip("redis-server is not installed and could not be installed")
    model = tiny_model("deepseek_v2")
    batch = [token_prompt(300, seed=40 + i) for i in range(4)]
    phases = [Phase("batch", batch, max_tokens=300)]
    # Block size given, not left to vLLM: the block count is in its units.
    engine = {"block_size": 16, "num_gpu_blocks_override": 48, "max_num_seqs": 4}
    # The engine core in the test's process, and lookups answered in the
    # step: the batch is queued whole before the first step, and no request
    # waits a step for its lookup, so both engines admit alike (with the
    # engine core in its own process, or lookups on a thread, which
    # requests a step takes follows timing).
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kw = dict(model=model, dtype="bfloat16", max_model_len=640)
    steps, ref_steps = [], []
    with RedisServer(tmp_path) as redis:
        env = {**in_process, "LMCACHE_REMOTE_URL": redis.url, "LMCACHE_REMOTE_SERDE": "naive",
               "LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "128", "LMCACHE_LOOKUP_TIMEOUT_MS": "10000",
               "LMCACHE_ASCEND_ASYNC_LOOKUP": "off"}
        got, log = run_engine_in(tmp_path, Scenario(phases=phases, engine_kwargs=engine, env=env, **kw),
                                 schedule=steps)
        with redis.client() as c:
            in_redis = c.dbsize()
    ref, _ = run_engine_in(tmp_path, Scenario(connector="none", phases=phases, engine_kwargs=engine, env=in_process,
                                              **kw), schedule=ref_steps)
    roomy = {k: v for k, v in engine.items() if k != "num_gpu_blocks_override"}
    free, _ = run_engine_in(tmp_path, Scenario(connector="none", phases=phases, engine_kwargs=roomy, env=in_process,
                                               **kw))

    loaded = {int(m[1]): int(m[2]) for m in re.finditer(
        r"lmcache-ascend: request (\d+)-\S+: hit \d+ tokens \(vLLM had \d+\), loaded (\d+) tokens", log)}
    resumed = {i for i, n in loaded.items() if n > 0}
    check_preempted_resumes(batch, got[0], ref[0], free[0], steps, ref_steps, log, resumed, "MLA")
    assert in_redis >= 2, "nothing reached Redis"


USER_SCRIPT = '''
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    model, prompt, done, tp, delete = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              tensor_parallel_size=tp,
              kv_transfer_config={"kv_connector": "LMCacheAscendConnectorV1Dynamic", "kv_role": "kv_both",
                                  "kv_connector_module_path": "%s"})
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=4, temperature=0.0))
    print("tokens", list(out[0].outputs[0].token_ids), flush=True)
    open(done, "w").write("done")
    if delete == "del":
        del llm
    # Otherwise no `del llm`, no shutdown: what user scripts and notebooks do.
'''

# How a user runs `LLM` (engine core in-process or in its own process, with
# or without `del llm`, TP=2): each must exit by itself with its chunks on
# disk. (engine core multiprocessing, tensor-parallel size, "del" or "keep")
SCRIPT_MODES = {
    "in_process": ("0", 1, "keep"),
    "multiprocess": ("1", 1, "keep"),
    "multiprocess_del": ("1", 1, "del"),
    "tp2": ("1", 2, "keep"),
}


# Each supported vLLM shuts its engine core and workers down with code of its
# own (in-process engines are closed late or never), so every mode runs on
# every stack.
@pytest.mark.compat
@pytest.mark.parametrize("mode", sorted(SCRIPT_MODES))
def test_user_script_exits_and_keeps_its_chunks(tmp_path, tiny_model, mode):
    """A script that builds ``LLM`` with the connector, generates and ends
    must exit by itself with code 0, with every chunk it stored on disk: with
    the engine core in-process (vLLM 0.32 closes that engine only when it is
    garbage collected or at exit, after Python joined LMCache's non-daemon
    storage thread; older vLLMs never do), in its own process with and
    without ``del llm``, and with TP=2 (each rank stores its own shard)."""
    import json
    import os
    import subprocess
    import sys

    from lmcache_ascend.cli.engine_run import CONNECTOR_MODULE

    from .conftest import EXIT_GRACE_S, wait_for_exit

    model = tiny_model("llama")
    prompt = token_prompt(3 * CHUNK + 10, seed=13)
    disk = tmp_path / "disk"
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT % CONNECTOR_MODULE)
    done = tmp_path / "done"
    multiprocessing, tp, delete = SCRIPT_MODES[mode]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LMCACHE_LOCAL_DISK": f"file://{disk}/",
           "LMCACHE_MAX_LOCAL_DISK_SIZE": "1", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
           "LMCACHE_CHUNK_SIZE": str(CHUNK)}
    if tp > 1:  # vLLM-CPU runs TP>1 only with its threads bound to one NUMA node
        env["VLLM_CPU_OMP_THREADS_BIND"] = one_core_per_rank(tp)
    env.pop("PYTHONHASHSEED", None)
    with open(tmp_path / "script.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), model, json.dumps(prompt), str(done), str(tp), delete],
                                stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path), env=env)
        hung = wait_for_exit(proc, done, 600, EXIT_GRACE_S)
    text = (tmp_path / "script.log").read_text(errors="replace")
    assert hung is None, f"the script {hung}:\n{text[-4000:]}"
    assert proc.returncode == 0, text[-4000:]
    assert "tokens [" in text
    # Its 3 whole chunks (per TP rank) were written before the process ended.
    assert len(list(disk.glob("*.pt"))) >= 3 * tp, (sorted(disk.iterdir()) if disk.exists() else "no disk dir",
                                                text[-3000:])
