"""Routers of the admin API, one per resource."""
