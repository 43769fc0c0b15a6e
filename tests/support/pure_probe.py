"""Imports one test module in a fresh interpreter and prints, as one JSON
line, whether it carries the ``pure`` marker and which vLLM and LMCache
modules importing it loaded (tests/unit/test_pure_marker.py).

Run as a script with tests/ on PYTHONPATH: this folder, the script's, is
then first on the import path, and the module imports what it would under
pytest, where tests/conftest.py puts both folders there."""

import importlib.util
import json
import sys


def main(path: str) -> None:
    spec = importlib.util.spec_from_file_location("probe_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    print(json.dumps({
        "pure": any(m.name == "pure" for m in marks),
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "lmcache")),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
