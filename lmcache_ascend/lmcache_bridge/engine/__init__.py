"""The LMCache engine as the connector's halves own it, its config, and the
hand-off of each step's stores.

* ``lmcache_engine``: the worker's engine and lookup server, the scheduler's lookup
  client, the deterministic chunk-hash seed, our loggers joining LMCache's
  logging setup.
* ``config``: our keys registered in LMCache's config,
  ``kv_connector_extra_config`` applied, startup validation, the engine
  settings our chunk path needs.
* ``chunk_io``: the chunk buffer and the GPU-connector hook LMCache calls.
* ``step_puts``: a step's seals and disk/remote puts, handed to LMCache once
  per step, off the step's thread.
* ``hash_memo``: a memo of LMCache's chunk prefix hashes.
* ``resources``: closing LMCache resources with a deadline.

Importing this package imports nothing. Of its modules, ``lmcache_engine`` and
``chunk_io`` import LMCache when imported; the others import it only inside
their functions, if at all.
"""
