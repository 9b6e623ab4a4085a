"""The data path: the bytes' way between a store or load call and the caller.

Extent format, read plans, load targets, staging rings and buffers, the runtime's executors, the
loader, sealing, first-layer bookkeeping and CPU pinning. Nothing here opens an index transaction;
the services above hand it plans and keys.
"""
