"""The ``lmcache-ascend`` command (``demo``, ``explain``) and what it needs
to run a real engine: ``engine_run`` (one scripted engine per process),
``spawn`` (runs it; its workers write their plans to a file),
``plan_file`` (reads that plan: the one reader), ``tiny_models`` (local
random-weight models; nothing is downloaded)."""
