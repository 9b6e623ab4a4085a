"""Logs an operator's tools can parse: one JSON object per line, with the request's id.

Standard library logging only (a :class:`logging.Formatter`), so an embedding server keeps its
own handlers and this module adds no dependency. ``tenantkv serve --log-format json`` (or
``[server] log_format = "json"``) installs it on the root logger.

What a line may carry is decided here, not by each call site:

- the request id of the admin API request being served (``request_id``, from a context variable
  the request middleware sets), so the lines of one request can be joined to its audit record;
- a tenant name only when the operator allows it (``tenant_names=True``; ``[server]
  log_tenants``): a log shipped to a shared system would otherwise list every tenant;
- never a secret: admin tokens (``tkv_...``), inference keys (``tkvi_...``) and bearer
  credentials are replaced by ``[redacted]`` in the message and the traceback, whatever logged
  them. Prompt text is never logged by tenantkv (request bodies are not logged at all); the
  access line names the route's template (``/v1/tenants/{name}``), not the path.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from contextvars import ContextVar
from typing import Any, Final, Literal

#: The id of the admin API request being served, for every line logged while it runs.
REQUEST_ID: ContextVar[str | None] = ContextVar("tenantkv_request_id", default=None)

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")

_SECRET = re.compile(
    r"(?i)\bbearer\s+\S+"  # an Authorization header's value, whatever its token
    r"|\btkvi?_[A-Za-z0-9_-]{8,}"  # admin tokens and inference keys
)
REDACTED: Final = "[redacted]"

#: Attributes every LogRecord has; anything else was passed with ``extra=`` and is kept.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's copy of the message with terminal colours
}


def redact(text: str) -> str:
    """``text`` with every admin token, inference key and bearer credential replaced."""
    return _SECRET.sub(REDACTED, text)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, ``request_id`` when a request is being served, fields passed with
    ``extra=``, and ``exception`` for a traceback; secrets redacted (module docstring).

    ``tenant_names=False`` (the default) drops a ``tenant`` field given with ``extra=``."""

    def __init__(self, *, tenant_names: bool = False) -> None:
        super().__init__()
        self.tenant_names = tenant_names

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key in _STANDARD or key in entry:
                continue
            if key == "tenant" and not self.tenant_names:
                continue
            entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(log_format: LogFormat, *, level: str = "info", tenant_names: bool = False) -> None:
    """Send the process's logs to stderr in ``log_format``: ``"json"`` installs a
    :class:`JsonFormatter` on the root logger (replacing its handlers), ``"text"`` leaves
    logging as it is. An unknown format is a ValueError naming the accepted ones."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if log_format == "text":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(tenant_names=tenant_names))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
