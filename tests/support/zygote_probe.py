"""A module the zygote tests run as ``python -m zygote_probe OUT [thread]``:
writes what tells two processes apart (the hash of a string, which
PYTHONHASHSEED randomises per interpreter; the pid) and, with ``thread``,
leaves a non-daemon thread running, which must keep the process alive as it
would keep a fresh interpreter alive; with ``until=PATH``, runs until PATH
exists and exits with status 5. It also writes its ``LMCA_PROBE_*``
variables."""

import json
import os
import sys
import threading
import time

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
    with open(out, "w") as f:
        json.dump({"hash": hash("lmcache-ascend"), "pid": os.getpid(),
                   "vllm_imported_before_main": "vllm" in sys.modules,
                   "env": {k: v for k, v in os.environ.items() if k.startswith("LMCA_PROBE_")}}, f)
    sys.exit(int(mode) if mode.isdigit() else 0)
