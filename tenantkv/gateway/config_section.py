"""The configuration file's ``[gateway]`` table: what ``tenantkv gateway`` serves, and how.

The table holds every :class:`~tenantkv.gateway.settings.GatewaySettings` field (its defaults
are taken from there, so they live in one place) and what the command line gives besides: the
backends, the address to listen on, and the *paths* of the gateway secret and of the signing
key. The secrets themselves are never in the file (no key takes one inline): the file is read
by every component of a deployment, the secrets by the gateway alone.

Precedence: a command-line flag > the file > defaults. There are no ``TENANTKV_GATEWAY_*``
variables: the gateway never read any, each of its settings already has a flag, and a second
set of names beside the admin server's ``TENANTKV_HOST``/``TENANTKV_PORT`` would be one more
thing to misspell (an unknown ``TENANTKV_*`` variable is refused, so one cannot be set by
mistake and silently ignored). The one variable it shares is ``TENANTKV_LOG_FORMAT``
(``tenantkv.cli.gateway.gateway_options``: flag > variable > file): a host ships the logs of
its admin server and gateway to the same place, in the same format.

Every key is checked when the table is built, so ``tenantkv config check`` reports a bad
backend URL or an out-of-range limit with its file, line and field; whether the secret files
can be read is checked when the gateway starts (they are readable by its user alone, not
necessarily by whoever checks the file).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Final

from ..config import check_environment
from ..errors import InvalidRequestError
from ..json_logs import LOG_FORMATS
from ..settings_file import CONFIG_ENV, Section, SettingsFile
from .settings import GatewaySettings, check_backends

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8480
#: The table keys that name files holding secrets (read when the gateway starts).
SECRET_FILE_KEYS: Final = ("secret_file", "signing_key_file")
#: Stands in for an audience the table leaves to ``--audience``, so that the table's limits
#: are still checked by :class:`GatewaySettings` itself, with its own bounds and messages.
_STAND_IN_AUDIENCE: Final = "audience-given-on-the-command-line"

_SETTINGS_DEFAULTS: Final[dict[str, Any]] = {
    f.name: f.default for f in dataclasses.fields(GatewaySettings) if f.init
}


@dataclass(frozen=True, kw_only=True)
class GatewayTable:
    """The ``[gateway]`` table. Any key may be left to a flag; what the gateway cannot start
    without (an audience, a backend, both secret files) is required once flags are applied
    (:meth:`missing`)."""

    audience: str | None = None
    #: ``vllm serve`` base URLs, ``http(s)://host[:port][/path]`` (``--backend`` replaces them).
    backends: list[str] = field(default_factory=list)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    #: Path of the file holding the gateway secret (at least 32 bytes).
    secret_file: str | None = None
    #: Path of the gateway's PEM Ed25519 private key (the nodes hold its public half).
    signing_key_file: str | None = None
    assertion_lifetime: float = _SETTINGS_DEFAULTS["assertion_lifetime"]
    max_body_bytes: int = _SETTINGS_DEFAULTS["max_body_bytes"]
    max_response_bytes: int = _SETTINGS_DEFAULTS["max_response_bytes"]
    max_concurrency_per_key: int = _SETTINGS_DEFAULTS["max_concurrency_per_key"]
    max_connections: int = _SETTINGS_DEFAULTS["max_connections"]
    connect_timeout: float = _SETTINGS_DEFAULTS["connect_timeout"]
    upstream_timeout: float = _SETTINGS_DEFAULTS["upstream_timeout"]
    health_timeout: float = _SETTINGS_DEFAULTS["health_timeout"]
    backend_cooldown: float = _SETTINGS_DEFAULTS["backend_cooldown"]
    affinity_chars: int = _SETTINGS_DEFAULTS["affinity_chars"]
    affinity_messages: int = _SETTINGS_DEFAULTS["affinity_messages"]
    #: ``text`` (default) or ``json``: the log lines of ``tenantkv.json_logs``, as ``tenantkv
    #: serve`` writes them (``--log-format``, ``TENANTKV_LOG_FORMAT``).
    log_format: str = "text"

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise InvalidRequestError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if not isinstance(self.host, str) or not self.host or not self.host.isprintable():
            raise InvalidRequestError(f"host must be a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise InvalidRequestError(f"port must be a whole number, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be from 0 to 65535, got {self.port!r}")
        for key in SECRET_FILE_KEYS:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{key} must be the path of a file, got {value!r}")
        if self.backends:
            check_backends(list(self.backends))
        self.settings(self.audience if self.audience is not None else _STAND_IN_AUDIENCE)

    def settings(self, audience: str | None = None) -> GatewaySettings:
        """The :class:`GatewaySettings` this table describes (``audience`` stands in for the
        table's own where given)."""
        tuning = {name: getattr(self, name) for name in _SETTINGS_DEFAULTS}
        tuning["audience"] = audience if audience is not None else self.audience
        return GatewaySettings(**tuning)

    def missing(self) -> list[str]:
        """What the gateway cannot start without and neither the file nor a flag gave."""
        needed = {
            "audience": self.audience,
            "backends": self.backends,
            "secret_file": self.secret_file,
            "signing_key_file": self.signing_key_file,
        }
        return [name for name, value in needed.items() if not value]


#: The configuration file's ``[gateway]`` table (no environment variables: see the module).
GATEWAY_SECTION = Section("gateway", GatewayTable, from_env=False)


def load_gateway_table(
    config_file: str | os.PathLike[str] | None = None, **flags: Any
) -> GatewayTable:
    """The gateway's table: ``flags`` (those not None) > the ``[gateway]`` table of
    ``config_file`` (else of the file ``TENANTKV_CONFIG`` names) > defaults. A file value is
    checked as ``tenantkv config check`` checks it, its error naming the file, line and field;
    a secret file the table names that cannot be read is such an error too, so the operator
    learns which line to fix rather than just which path failed."""
    check_environment(os.environ)
    given = {name: value for name, value in flags.items() if value is not None}
    path = config_file or os.environ.get(CONFIG_ENV) or None
    if path is None:
        return GatewayTable(**given)
    settings_file = SettingsFile.read(path)
    settings_file.check_sections()

    def build(values: dict[str, Any], environ: Any) -> GatewayTable:
        return GatewayTable(**{**values, **given})

    table: GatewayTable = settings_file.build(
        dataclasses.replace(GATEWAY_SECTION, build=build), os.environ
    )
    from_file = settings_file.table(GATEWAY_SECTION)
    for key in SECRET_FILE_KEYS:
        if key in from_file and key not in given:
            try:
                with open(from_file[key], "rb"):
                    pass
            except OSError as err:
                raise settings_file.error(
                    "gateway", key, f"cannot read {from_file[key]}: {err.strerror}"
                ) from None
    return table
