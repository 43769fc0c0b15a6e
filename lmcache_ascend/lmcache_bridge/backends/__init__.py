"""LMCache's remote stores (``remote_url``) as this connector runs them.

* ``remote_pool``: a store that is down is an outage, not a fault: startup
  checks (misconfiguration stops startup, an unreachable pool does not
  unless ``ascend_require_remote``), the Redis PING with the URL's
  credentials, reconnecting once the store is back.
* ``mooncake``: Mooncake's setup keys validated at startup (with a probe in a
  child process) and its run-time failures counted.
* ``credentials``: the store's passwords never reach a log line or an error.
* ``redis_reads``: the staged lookups read a ``redis://`` pool's entries on
  redis-py's synchronous client (with hiredis), LMCache's format, and any
  other backend through LMCache's own reads (``read_prefix``).

Importing this package imports nothing; none of its modules imports LMCache
at import time.
"""
