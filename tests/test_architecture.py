"""The import contracts hold, and the check fails when they are broken.

``scripts/test.sh`` runs ``lint-imports`` on the assembled package; this test proves the check is
not vacuous: the same contracts pass on the tree as it is (positive control) and fail on a copy
with one deliberate violation, an import of the facade from a service hidden under
``TYPE_CHECKING``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _assemble(target: Path) -> Path:
    package = target / "tenantkv"
    shutil.copytree(REPO / "tenantkv", package, ignore=shutil.ignore_patterns("__pycache__"))
    for leaf in ("crypto", "storage", "audit"):
        shutil.copytree(REPO / leaf, package / leaf, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(REPO / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed")
def test_import_contracts_hold_and_a_hidden_upward_import_breaks_them(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    _assemble(kept)
    result = _lint(kept)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout

    broken = tmp_path / "broken"
    service = _assemble(broken) / "services" / "gc.py"
    source = service.read_text()
    service.write_text(
        source.replace(
            "from ..components.context import CacheContext\n",
            "from ..components.context import CacheContext\n\nif TYPE_CHECKING:\n"
            "    from ..api import TenantKV  # noqa: F401\n",
            1,
        ).replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n",
            1,
        )
    )
    result = _lint(broken)
    assert result.returncode != 0
    assert "tenantkv.services is not allowed to import tenantkv.api" in result.stdout
    assert "No cycles are allowed in tenantkv" in result.stdout
