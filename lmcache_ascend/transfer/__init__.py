"""Moving chunks between paged KV and a flat chunk buffer through an ops
module (the compiled lmcache_ascend.ops, or reference_ops); no vLLM, no LMCache."""
