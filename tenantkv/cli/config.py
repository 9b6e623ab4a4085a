"""``tenantkv config check FILE`` and ``tenantkv config show [FILE]``: the configuration file.

``check`` validates every section the file holds (and the ``[cache]`` table's defaults), as the
components would at start with this process's environment: exit 0 and a one-line summary, or
the error sentence (file, line, field) and exit 2. ``show`` prints the effective settings
(environment > file > defaults), each with where it came from, secrets masked.

``validate_file`` is what every other command runs first when a file is in play (``--config``
or ``TENANTKV_CONFIG``), so a misspelt key stops the command rather than being ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import check_environment
from ..settings_file import (
    CONFIG_ENV,
    Section,
    SettingsFile,
    mask,
    section,
)


def _sections(settings: SettingsFile | None) -> list[tuple[str, Section | None, str]]:
    """(name, section or None where its component is not installed, why) of every section
    worth checking: those the file holds, and ``cache`` and ``server`` always (their defaults
    are a configuration too)."""
    names = ["cache", "server", *sorted(set(settings.data if settings else {}) - {"cache"})]
    found: list[tuple[str, Section | None, str]] = []
    for name in dict.fromkeys(names):
        try:
            found.append((name, section(name), ""))
        except ImportError as err:  # an extra that is not installed here
            found.append((name, None, f"not checked here: {err}"))
    return found


def validate_file(path: str | os.PathLike[str], environ: Mapping[str, str]) -> list[str]:
    """Check every section of the file at ``path``; the names of those checked (a
    ConfigFileError for the first problem)."""
    settings = SettingsFile.read(path)
    settings.check_sections()
    checked = []
    for name, spec, _ in _sections(settings):
        if spec is None or (name not in settings.data and name != "cache"):
            continue
        settings.build(spec, environ)
        checked.append(name)
    return checked


def _cmd_check(args: argparse.Namespace) -> int:
    check_environment(os.environ)
    checked = validate_file(args.file, os.environ)
    settings = SettingsFile.read(args.file)
    skipped = [n for n, spec, _ in _sections(settings) if spec is None and n in settings.data]
    note = f"; not checked here (component not installed): {', '.join(skipped)}" if skipped else ""
    print(f"ok: {args.file} ({', '.join(checked)}){note}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    check_environment(os.environ)
    path = args.file or os.environ.get(CONFIG_ENV) or None
    settings = SettingsFile.read(path) if path else None
    if settings is not None:
        settings.check_sections()
    empty = SettingsFile(Path("(no file)"), "", {})
    print(f"# tenantkv settings: environment > {path or '(no file)'} > defaults; secrets masked")
    for name, spec, why in _sections(settings):
        print(f"\n[{name}]")
        if spec is None:
            print(f"# {why}")
            continue
        source = settings if settings is not None else empty
        if name not in source.data and name != "cache":
            try:
                built = source.build(spec, os.environ)
            except (ValueError, TypeError) as err:  # needs keys only a file gives
                print(f"# not configured ({err})")
                continue
        else:
            built = source.build(spec, os.environ)
        table = source.data.get(name, {})
        for key, value in _values(built, spec).items():
            origin = (
                f"env {spec.env_name(key)}"
                if spec.from_env and os.environ.get(spec.env_name(key))
                else "file"
                if key in table
                else "default"
            )
            shown = mask(key, value)
            if shown is None:
                print(f"# {key} = (unset)  # {origin}")
            else:
                print(f"{key} = {json.dumps(shown)}  # {origin}")
    return 0


def _values(built: Any, spec: Section) -> dict[str, Any]:
    """The model's settable fields, as plain values (paths and suites as text)."""
    names = list(spec.fields())
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(built, name)
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, enum.Enum):  # a cipher suite: its name, as the file writes it
            value = value.name.lower().replace("_", "-")
        elif dataclasses.is_dataclass(value) or not isinstance(
            value, str | int | float | bool | list | tuple | dict | type(None)
        ):
            value = getattr(value, "name", str(value))
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def register(commands: Any) -> None:
    """Add ``config check`` and ``config show`` to the CLI's subcommands."""
    config = commands.add_parser(
        "config", help="check or show the configuration file (docs/deploy.md)"
    )
    sub = config.add_subparsers(dest="config_command", required=True)
    check = sub.add_parser("check", help="validate a configuration file (exit 0: ok)")
    check.add_argument("file")
    check.set_defaults(handler=_cmd_check)
    show = sub.add_parser("show", help="the effective settings, secrets masked")
    show.add_argument("file", nargs="?", default=None, help=f"default: ${CONFIG_ENV}")
    show.set_defaults(handler=_cmd_show)
