"""``tenantkv conformance``: prove a live deployment's isolation from the outside, through its
gateway (docs/gateway.md, "Proving isolation").

* :mod:`probe` -- one request as a client sends it, and what its answer tells (cached tokens,
  time to first token);
* :mod:`suite` -- the matrix (identity dimension x entrypoint x tier), the attacks and the
  timing audit, each "other identity -> miss" case paired with its "same identity -> hit"
  control;
* :mod:`report` -- the verdict rule, the table and the JSON report;
* :mod:`ks` -- the two-sample Kolmogorov-Smirnov test of the timing audits.

Needs httpx (the gateway extra) only to run; the report and the KS test need nothing.
"""
