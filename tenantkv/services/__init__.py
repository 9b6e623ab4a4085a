"""Services: what the cache does, each taking only components (``tenantkv.context``), never the
``CacheContext`` facade. Namespaces (store, lookup, load, prefetch), tenants, and maintenance (GC,
key retirement by re-sealing, purges)."""
