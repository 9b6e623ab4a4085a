"""Import every module of the installed tenantkv; used by scripts/check_package.sh.

    python scripts/pkgcheck_imports.py [MODULE ...]

MODULEs are the top-level modules that only other extras bring (e.g. ``fastapi`` when checking
the base install): a tenantkv module whose import fails because one of those is missing is
listed, not failed. Any other failure, above all a ModuleNotFoundError for an undeclared
dependency, exits non-zero. Modules are found from the installed distribution's file list, so
the check sees exactly what the wheel installed (run it from outside the source tree).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import traceback


def _missing_module(err: BaseException) -> str | None:
    """The top-level name of the module whose absence caused ``err`` (through its causes)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            return seen.name.split(".")[0]
        seen = seen.__cause__ or seen.__context__
    return None


def main(argv: list[str]) -> int:
    other_extras = set(argv[1:])
    files = importlib.metadata.files("tenantkv") or []
    names = sorted(
        ".".join(path.with_suffix("").parts).removesuffix(".__init__")
        for path in (f for f in files if f.suffix == ".py")
    )
    names = [name for name in names if name.split(".")[-1] != "__main__"]
    if not names or not all(name.split(".")[0] == "tenantkv" for name in names):
        print(f"unexpected module list from the installed files: {names}", file=sys.stderr)
        return 1
    imported: list[str] = []
    other: list[str] = []
    failed: list[tuple[str, Exception]] = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:
            missing = _missing_module(err)
            if missing in other_extras:
                other.append(f"{name} ({missing})")
            else:
                failed.append((name, err))
        else:
            imported.append(name)
    where = importlib.metadata.distribution("tenantkv").locate_file("tenantkv")
    print(f"imported {len(imported)} of {len(names)} modules of {where}")
    if other:
        print(f"  left to other extras: {', '.join(other)}")
    if failed:
        first_name, first_err = failed[0]
        print(f"FAILED to import {len(failed)} modules; the first, {first_name}:", file=sys.stderr)
        traceback.print_exception(first_err, file=sys.stderr)
        for name, err in failed:
            print(f"  {name}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
