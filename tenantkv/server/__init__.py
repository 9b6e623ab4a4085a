"""The admin API: an authenticated HTTP service for tenant management (FastAPI).

The package root imports nothing heavy so that ``tenantkv token ...`` works without the server
extras installed; the app lives in :mod:`tenantkv.server.app` (``create_app``, ``run``). Tokens
are a service (:mod:`tenantkv.services.tokens`, ``kv.tokens``), so the CLI has them without the
server. See ``docs/admin-api.md``.
"""
