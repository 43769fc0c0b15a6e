"""What makes a chunk trustworthy before the connector promises it to vLLM.

* ``staging``: the lookup reads, verifies and holds every chunk it reports,
  so the load that follows cannot fail on it; damaged entries are
  quarantined.
* ``pool_secret``: the secret that authenticates every entry written to disk
  or a shared store (the MAC in each chunk's trailer, ``engine.chunk_io``).

Importing this package imports nothing, and neither module imports LMCache
or vLLM when imported (``staging`` works on the LMCache objects it is given).
"""
