"""The configuration file: one TOML file, one table per component, every key validated.

Each component owns a *section* (``[cache]``, ``[server]``, ``[vllm]``, ...): a :class:`Section`
names the table and the model that validates it (a dataclass or a pydantic model). The sections
live beside their models, in the layers that own them (the server and the integrations sit above
this module), so the table :data:`SECTIONS` names each by ``"module:attribute"`` and imports it
only when a file is checked; one line adds a component. :func:`register_section` adds one at
run time.

Why our own reader around :mod:`tomllib`: an operator who misspells a key must be told, in one
sentence, which file, which line and which field, and ``tomllib`` knows neither lines nor our
fields. Every problem is a :class:`ConfigFileError` (an ``InvalidRequestError``), worded
``FILE, line N: section.field: problem``.

Precedence, for every section whose values also come from ``TENANTKV_<FIELD>`` variables:
environment > file > defaults (a command-line flag, where a command has one, beats all three).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .errors import InvalidRequestError

ENV_PREFIX = "TENANTKV_"
#: The environment variable naming the configuration file (``--config`` on the CLI wins).
CONFIG_ENV = ENV_PREFIX + "CONFIG"
MASK = "***"

#: Every section a file may hold, by ``"module:attribute"`` of its :class:`Section`.
SECTIONS: dict[str, str] = {
    "cache": "tenantkv.config:CACHE_SECTION",
    "server": "tenantkv.server.settings:SERVER_SECTION",
    "vllm": "tenantkv.integrations.vllm.settings:CONNECTOR_SECTION",
    "gateway": "tenantkv.gateway.config_section:GATEWAY_SECTION",
}

#: Field names whose whole value is a secret (shown as ``***``).
_SECRET_NAME = re.compile(
    r"secret|password|passwd|private_key|signing_key|api_key|master_key|_token$|^token$", re.I
)
#: URL query parameters whose value is a secret.
_SECRET_PARAM = re.compile(r"pass|secret|token|key", re.I)
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_DATABASE_SCHEMES = ("sqlite", "postgresql")


class ConfigFileError(InvalidRequestError):
    """A configuration file that cannot be used: unreadable, not TOML, an unknown section or
    key, a value of the wrong type or out of range, a malformed URL. The message names the
    file, the line (where the problem has one) and the field."""

    def __init__(self, file: Path | str, line: int | None, field: str | None, problem: str):
        self.file = str(file)
        self.line = line
        self.field = field
        self.problem = problem
        where = self.file if line is None else f"{self.file}, line {line}"
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")


@dataclass(frozen=True)
class Section:
    """One component's table: ``model`` validates it (a dataclass or a pydantic model, whose
    own checks run on every value); ``exclude`` are model fields the file may not set (objects,
    or a field another section owns); ``from_env``: ``TENANTKV_<FIELD>`` variables override the
    file's values. ``build`` replaces the default construction (``model(**values)``) where a
    model reads its environment its own way; it gets the file's values (already type-checked)
    and the environment, and applies the precedence itself."""

    name: str
    model: type
    exclude: frozenset[str] = frozenset()
    from_env: bool = True
    build: Callable[[dict[str, Any], Mapping[str, str]], Any] | None = None
    hints: dict[str, Any] = field(default_factory=dict, compare=False)

    def fields(self) -> dict[str, Any]:
        """Field name -> type of every key the file may set."""
        if not self.hints:
            self.hints.update(_model_hints(self.model))
        return {k: v for k, v in self.hints.items() if k not in self.exclude}

    def env_name(self, name: str) -> str:
        return ENV_PREFIX + name.upper()


def register_section(section: Section | str, target: str | None = None) -> None:
    """Add a section: a :class:`Section`, or a name and the ``"module:attribute"`` of one."""
    if isinstance(section, Section):
        _registered[section.name] = section
    else:
        if target is None:
            raise ValueError("register_section(name, 'module:attribute')")
        SECTIONS[section] = target


_registered: dict[str, Section] = {}


def section(name: str) -> Section:
    """The :class:`Section` called ``name`` (ImportError: its component is not installed)."""
    if name in _registered:
        return _registered[name]
    module, _, attribute = SECTIONS[name].partition(":")
    found = getattr(importlib.import_module(module), attribute)
    if not isinstance(found, Section):
        raise TypeError(f"{SECTIONS[name]} is not a Section")
    return found


def known_sections() -> list[str]:
    return sorted(set(SECTIONS) | set(_registered))


@dataclass(frozen=True)
class SettingsFile:
    """A parsed file and its text (for line numbers)."""

    path: Path
    text: str
    data: dict[str, Any]

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> SettingsFile:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigFileError(path, None, None, f"cannot be read ({err})") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            line = getattr(err, "lineno", None) or _line_in_message(str(err))
            raise ConfigFileError(path, line, None, f"is not valid TOML: {err}") from None
        return cls(path, text, data)

    def line_of(self, *keys: str) -> int | None:
        """The line that sets ``keys`` (a table path then a key), or the nearest enclosing one."""
        return key_line(self.text, keys)

    def error(self, section: str, key: str | None, problem: str) -> ConfigFileError:
        keys = (section,) if key is None else (section, key)
        return ConfigFileError(self.path, self.line_of(*keys), ".".join(keys), problem)

    def check_sections(self) -> None:
        """Every top-level key is a known section, and a table."""
        known = known_sections()
        for name, value in self.data.items():
            if name not in known:
                raise self.error(
                    name, None, f"unknown section (known: {', '.join(known)})"
                ) from None
            if not isinstance(value, dict):
                raise self.error(name, None, "must be a table ([" + name + "])")

    def table(self, spec: Section) -> dict[str, Any]:
        """The section's values, each key known and each value of its field's type."""
        raw = self.data.get(spec.name, {})
        if not isinstance(raw, dict):
            raise self.error(spec.name, None, "must be a table ([" + spec.name + "])")
        fields = spec.fields()
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                hint = _closest(key, fields)
                raise self.error(spec.name, key, "unknown setting" + hint)
            problem = type_problem(value, fields[key])
            if problem is None and key.endswith("_url"):
                problem = url_problem(key, value)
            if problem is not None:
                raise self.error(spec.name, key, problem)
            values[key] = value
        return values

    def build(self, spec: Section, environ: Mapping[str, str]) -> Any:
        """The section's model from this file and ``environ`` (environment > file > defaults);
        a value the model refuses is an error naming its line and field."""
        values = self.table(spec)
        try:
            if spec.build is not None:
                return spec.build(values, environ)
            if spec.from_env:
                values = {k: v for k, v in values.items() if not environ.get(spec.env_name(k))}
            return spec.model(**values)
        except InvalidRequestError as err:
            if isinstance(err, ConfigFileError):
                raise
            raise self._attributed(spec, values, environ, str(err)) from None
        except (ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
            raise self._attributed(spec, values, environ, _first_error(err)) from None

    def _attributed(
        self, spec: Section, values: dict[str, Any], environ: Mapping[str, str], message: str
    ) -> Exception:
        """The error of a refused model, pinned on the field that caused it: the one the model
        refuses alone, else the first one its message names. A value the environment overrode
        is not the file's fault: its error stays the model's own sentence."""
        if spec.from_env:
            values = {k: v for k, v in values.items() if not environ.get(spec.env_name(k))}
        key = _pydantic_field(message)
        message = re.sub(r"^\[field:\w+\]\s*", "", message)
        if key is None:
            for name, value in values.items():
                try:
                    spec.model(**{name: value})
                except (InvalidRequestError, ValueError, TypeError):
                    key = name
                    break
        if key is None:
            key = next((n for n in values if re.search(rf"\b{re.escape(n)}\b", message)), None)
        if key is None or key not in values:  # the environment's or a flag's, not the file's
            return InvalidRequestError(message)
        if key is not None:
            message = message.removeprefix(f"{key}: ")
        return self.error(spec.name, key, message)


# -- line numbers -----------------------------------------------------------------------------

_BARE = r"[A-Za-z0-9_\-]+"
_KEY_PART = rf"(?:{_BARE}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_KEY_PATH = re.compile(rf"\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*")


def _split_key(text: str) -> tuple[str, ...] | None:
    """``a."b.c".d`` -> ('a', 'b.c', 'd'); None if ``text`` is not a key path."""
    match = _KEY_PATH.fullmatch(text)
    if match is None:
        return None
    parts = re.findall(_KEY_PART, match.group(1))
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


def key_line(text: str, keys: tuple[str, ...]) -> int | None:
    """The 1-based line of ``text`` that sets the key path ``keys``, through ``[table]`` and
    ``[[array]]`` headers and dotted keys (``cache.root = ...``, ``[cache] root = ...``); else
    the line of its longest enclosing path found (an inline table, or the header). Multi-line
    strings are skipped, so a line inside one is never taken for a key."""
    target = tuple(keys)
    table: tuple[str, ...] = ()
    best: tuple[int, int] | None = None  # (depth matched, line)
    in_string: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if in_string is not None:
            if line.count(in_string) % 2 == 1:
                in_string = None
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        path: tuple[str, ...] | None = None
        header = re.match(r"^\[\[?([^\[\]]*)\]\]?\s*(#.*)?$", stripped)
        if header:
            found = _split_key(header.group(1))
            if found is not None:
                table = found
                path = found
        elif "=" in stripped:
            found = _split_key(_key_text(stripped))
            if found is not None:
                path = table + found
            rest = stripped.split("=", 1)[1]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2 == 1:
                    in_string = quote
                    break
        if path is None:
            continue
        if path == target:
            return number
        depth = _common_prefix(path, target)
        if depth == len(path) and (best is None or depth > best[0]):
            best = (depth, number)
    return None if best is None else best[1]


def _key_text(line: str) -> str:
    """The key part of a ``key = value`` line (an ``=`` inside a quoted key is kept)."""
    quote: str | None = None
    for index, char in enumerate(line):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "=":
            return line[:index]
    return line


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    depth = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        depth += 1
    return depth


def _line_in_message(message: str) -> int | None:
    match = re.search(r"line (\d+)", message)
    return int(match.group(1)) if match else None


# -- types ------------------------------------------------------------------------------------


def _model_hints(model: type) -> dict[str, Any]:
    fields = getattr(model, "model_fields", None)
    if isinstance(fields, dict):  # pydantic
        return {name: info.annotation for name, info in fields.items()}
    if dataclasses.is_dataclass(model):
        hints = typing.get_type_hints(model)
        return {f.name: hints[f.name] for f in dataclasses.fields(model) if f.init}
    raise TypeError(f"{model!r} is neither a dataclass nor a pydantic model")


def type_problem(value: Any, hint: Any) -> str | None:
    """None where a TOML value fits ``hint``, else what was expected (``expected an integer,
    got 'many'``). Strict on purpose: TOML has types, so ``port = "8470"`` is a mistake."""
    if _fits(value, hint):
        return None
    return f"expected {_describe(hint)}, got {value!r}"


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str or hint is Path:
        return isinstance(value, str)
    if origin in (list, tuple, set, frozenset) or origin is typing.get_origin(typing.Sequence[int]):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value if args)
    if origin in (dict,) or origin is typing.get_origin(typing.Mapping[str, int]):
        return isinstance(value, dict)
    if isinstance(hint, type):  # a value object that parses itself from text (a cipher suite)
        return isinstance(value, str)
    return False


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(_describe(a) for a in args)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if hint is Path:
        return "a path (a string)"
    if origin in (list, tuple, set, frozenset) or origin is typing.get_origin(typing.Sequence[int]):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin in (dict,) or origin is typing.get_origin(typing.Mapping[str, int]):
        return "a table"
    return "a string"


def url_problem(key: str, value: Any) -> str | None:
    """What is wrong with a URL setting (each of a comma-separated list of tiers), or None."""
    if not isinstance(value, str):
        return None
    for part in value.split(","):
        part = part.strip()
        if not _URL_SCHEME.match(part):
            return f"{part!r} is not a URL (scheme://...)"
        try:
            split = urlsplit(part)
            split.port  # noqa: B018 -- raises on a port that is not a number
        except ValueError as err:
            return f"{_mask_url(part)!r} is not a valid URL: {err}"
        if not split.netloc and not split.path:
            return f"{part!r} names no host and no path"
    if key == "database_url":
        scheme = value.split(":", 1)[0].split("+", 1)[0]
        if scheme not in _DATABASE_SCHEMES:
            return f"the index must be sqlite:///... or postgresql+psycopg://..., got {scheme}://"
    return None


# -- masking ----------------------------------------------------------------------------------


def mask(name: str, value: Any) -> Any:
    """``value`` fit to be shown: a secret field's whole value, and a URL's password or secret
    query parameter, replaced by ``***``. A ``*_file`` field (``secret_file``) holds the path
    of a secret, not the secret: shown, so an operator can see which file is used."""
    if isinstance(value, list | tuple):
        return [mask(name, v) for v in value]
    if isinstance(value, dict):
        return {k: mask(k, v) for k, v in value.items()}
    if value is None or value == "":
        return value
    if _SECRET_NAME.search(name) and not name.endswith("_file"):  # a path is not the secret
        return MASK
    if isinstance(value, str) and "://" in value:
        return ",".join(_mask_url(part) for part in value.split(","))
    return value


def _mask_url(url: str) -> str:
    """``url`` with its password and secret query values masked; otherwise untouched (a
    round trip through ``urlunsplit`` would turn ``sqlite:////abs`` into ``sqlite://abs``)."""
    try:
        split = urlsplit(url)
    except ValueError:
        return MASK
    masked = url
    if "@" in split.netloc:
        userinfo, host = split.netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        hidden = f"{user}:{MASK}@{host}" if ":" in userinfo else f"{MASK}@{host}"
        masked = masked.replace(split.netloc, hidden, 1)
    if split.query:
        pairs = parse_qsl(split.query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = "&".join(f"{k}={MASK if _SECRET_PARAM.search(k) else v}" for k, v in pairs)
            masked = masked.replace("?" + split.query, "?" + query, 1)
    return masked


# -- helpers ----------------------------------------------------------------------------------


def _closest(name: str, known: Mapping[str, Any]) -> str:
    import difflib

    match = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _pydantic_field(message: str) -> str | None:
    match = re.match(r"\[field:(\w+)\]", message)
    return match.group(1) if match else None


def _first_error(err: Exception) -> str:
    """One sentence from a model's error; pydantic's first error, tagged with its field."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
        except (IndexError, TypeError):
            return str(err)
        loc = first.get("loc") or ()
        name = str(loc[0]) if loc else ""
        return f"[field:{name}] {first.get('msg', str(err))}" if name else str(first.get("msg"))
    return str(err)
