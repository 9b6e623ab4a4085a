"""Alembic migration scripts of the index (``env.py`` and ``versions/``), shipped inside the
package and run programmatically by :mod:`tenantkv.index.migrate`: no ``alembic.ini`` is needed
at run time, and ``tenantkv db upgrade`` works from an installed wheel."""
