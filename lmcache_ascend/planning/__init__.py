"""Transfer planning: pure Python (torch tensor metadata and numpy only), no
vLLM, no LMCache, no compiled ops, so it is importable and testable anywhere."""
