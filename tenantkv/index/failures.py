"""Index and block-store failures as the one error type callers catch: CacheUnavailableError.

The driver's errors (``sqlalchemy.exc.OperationalError`` and its kin) and the block store's
(``StorageError``) are details of a backend; during an outage they reached callers of the
maintenance calls (``gc``, ``rotate_keys``, ``retire_keys``, hundreds of them in one run),
although ``tenantkv.errors`` promises ``CacheUnavailableError``. :func:`typed_failures` puts
the conversion on every public method of a class at once, so a method added later cannot leak
them either; the serving path's degradation (a miss, a skipped store) happens inside the
methods, before this backstop.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from sqlalchemy import URL, make_url
from sqlalchemy.exc import SQLAlchemyError

from ..errors import CacheUnavailableError
from ..storage import StorageError

#: What fails when the index or the block store does.
BACKEND_ERRORS: tuple[type[Exception], ...] = (SQLAlchemyError, StorageError)

C = TypeVar("C", bound=type)

logger = logging.getLogger("tenantkv")


def describe(err: BaseException) -> str:
    """One line that says what failed, without the driver's traceback hints and SQL: the
    CLI prints it as one sentence, the admin API puts it in a 503's detail."""
    cause = getattr(err, "orig", None) or err
    first = str(cause).strip().splitlines()
    return first[0] if first else type(cause).__name__


def shown_url(url: str | URL) -> str:
    """An index URL as messages show it: the operator's own, password hidden, without the
    driver's name (``postgresql://``, not ``postgresql+psycopg://``): the CLI prints it in its
    one sentence, which names no driver."""
    parsed = make_url(url)
    bare = parsed.set(drivername=parsed.get_backend_name())
    return bare.render_as_string(hide_password=True)


def unavailable(operation: str, err: BaseException) -> CacheUnavailableError:
    """The error a failed ``operation`` raises when the index or block store failed.

    Its text names the operation and the backend only: the admin API answers it (503) to
    clients, who must not learn the driver's hosts, statements or paths; those are logged here
    and stay in the chained cause."""
    backend = "block store" if isinstance(err, StorageError) else "index"
    logger.warning("%s failed: the %s failed: %s", operation, backend, describe(err))
    return CacheUnavailableError(f"{operation} failed: the {backend} is unavailable")


def _iterate(operation: str, items: Iterator[Any]) -> Generator[Any, None, None]:
    try:
        yield from items
    except BACKEND_ERRORS as err:
        raise unavailable(operation, err) from err


def _typed(operation: str, method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def generator(*args: Any, **kwargs: Any) -> Any:
            return (yield from _iterate(operation, method(*args, **kwargs)))

        return generator

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = method(*args, **kwargs)
        except BACKEND_ERRORS as err:
            raise unavailable(operation, err) from err
        if isinstance(result, Generator):  # read lazily (an audit export): convert there too
            return _iterate(operation, result)
        return result

    return call


def typed_failures(cls: C) -> C:
    """Make every public method and property of ``cls`` (inherited ones included) raise
    CacheUnavailableError where the index or block store fails."""
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attribute = inspect.getattr_static(cls, name)
        if isinstance(attribute, property) and attribute.fget is not None:
            wrapped = property(
                _typed(name, attribute.fget),
                attribute.fset and _typed(name, attribute.fset),
                attribute.fdel,
                attribute.__doc__,
            )
            setattr(cls, name, wrapped)
        elif isinstance(attribute, staticmethod | classmethod):
            continue
        elif inspect.isfunction(attribute):
            setattr(cls, name, _typed(name, attribute))
    return cls
