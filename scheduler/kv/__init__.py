"""The paged KV cache's bookkeeping: the block pool (reference counts, prefix-cache
hashes, eviction), the per-request block tables (kv_cache_manager), the block hashes,
the KV events the routers read, and the cache's dtype names."""
