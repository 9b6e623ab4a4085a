"""The metadata index: every SQL statement tenantkv runs lives in this package.

Services call the repositories here; nothing above this layer builds a query. The schema
(``schema``), the engine and its dialect strategy (``database``), and one repository module per
kind of row. Coordination that several nodes share -- leases on extents being read, the key
epoch, the store's capacity -- is index state, never one process's memory.
"""
