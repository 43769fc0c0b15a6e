"""The ``lmcache-ascend`` command (``demo``, ``explain``) and what it needs
to run a real engine: ``engine_run`` (one scripted engine per process),
``spawn`` (runs it and reads the worker's log), ``tiny_models`` (local
random-weight models; nothing is downloaded)."""
