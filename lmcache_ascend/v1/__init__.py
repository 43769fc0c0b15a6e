"""Transfer planning and chunk movement: pure Python, no vLLM, no compiled ops
at import time (groups, slot_mapping, kv_format, flatten, planner,
device_connector, config)."""
