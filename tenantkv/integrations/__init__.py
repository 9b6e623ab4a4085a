"""Integrations of tenantkv with inference frameworks.

Each integration lives in its own module and imports its framework only when that module is
imported, so ``import tenantkv`` never pulls in a framework the server does not use:

* :mod:`tenantkv.integrations.transformers` -- Hugging Face transformers (extra ``hf``).
"""
