"""The two-sample KS test of the timing audit: it lives in ``tenantkv.conformance.ks`` (the
``tenantkv conformance`` command's timing audit uses it too); this name stays for the
benchmark scripts that import it from ``bench/``."""

from tenantkv.conformance.ks import KsResult, kolmogorov_sf, ks_2samp, ks_statistic

__all__ = ["KsResult", "kolmogorov_sf", "ks_2samp", "ks_statistic"]
