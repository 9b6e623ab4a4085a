"""Services: what the cache does, each taking only components
(``tenantkv.components.context``), never the facade. Namespaces (store, lookup, load,
prefetch), tenants, and maintenance (GC, key retirement by re-sealing, purges)."""
