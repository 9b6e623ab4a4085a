"""The ``tenantkv`` command line (``commands.main``); one module per command family."""

from .commands import main

__all__ = ["main"]
