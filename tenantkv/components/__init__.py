"""The components of one open cache, built once by ``tenantkv.open`` (``context.py``).

Coordination between nodes, the bytes half of the one delete path, security incidents, the
serving policy, health counters, metering, the keyring and key guard, the node's lookup cache,
records of use and metrics. Services take these; they never take the facade.
"""
