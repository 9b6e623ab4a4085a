"""Start-up time of the ``tenantkv`` command line: ``tenantkv --help`` and a command that fails
on its argument before opening anything (``tenantkv usage --since 7x``), on this tree against a
baseline tree (a git ref, default the branch's merge base with main), alternating runs.

The CLI used to import torch and the data path for every command (the package's ``__init__``
and the CLI's modules imported them at the top); now only commands that open a cache do. Each
run is a fresh interpreter (``python -m tenantkv.cli ...``), so the figure is what an operator
waits. The baseline tree is assembled as the installed package is (``crypto/``, ``storage/``,
``audit/`` inside ``tenantkv/``, the compiled extensions copied) and put first on ``sys.path``.

    .venv/bin/python bench/cli_startup.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import format_ratios, format_stats_table, min_med_max
from _plots import pyplot, save_figure, whiskers

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"--help": ["--help"], "bad argument": ["usage", "/nonexistent", "--since", "7x"]}


def _tree(ref: str, into: Path) -> Path:
    """The package of ``ref`` laid out as installed, under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for leaf in ("crypto", "storage", "audit"):
        shutil.copytree(into / leaf, into / "tenantkv" / leaf)
    for built in (ROOT / "tenantkv").glob("*.so"):
        shutil.copy2(built, into / "tenantkv" / built.name)
    return into


def _once(tree: Path | None, argv: list[str]) -> float:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tenantkv.cli", *argv],
        env=env,
        cwd=tempfile.gettempdir(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return time.perf_counter() - started


def _imports_torch(tree: Path | None) -> bool:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    probe = "import sys, tenantkv.cli; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tempfile.gettempdir(), capture_output=True
    )
    return out.stdout.strip() == b"True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="git ref (default: merge-base with main)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    ref = (
        args.baseline
        or subprocess.run(
            ["git", "-C", str(ROOT), "merge-base", "HEAD", "main"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    load = os.getloadavg()
    print(f"cpus {os.cpu_count()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("(a shared, loaded machine: compare the same-run ratios, not the seconds)")
    with tempfile.TemporaryDirectory() as scratch:
        baseline = _tree(ref, Path(scratch))
        trees = {f"baseline {ref[:10]}": baseline, "this tree": None}
        for name, tree in trees.items():
            print(f"{name}: tenantkv.cli imports torch: {_imports_torch(tree)}")
        samples: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            order = list(trees.items()) if rep % 2 == 0 else list(reversed(trees.items()))
            for command, argv in COMMANDS.items():
                for name, tree in order:
                    samples.setdefault((command, name), []).append(_once(tree, argv))
    rows = [(f"{cmd} / {name}", values, "") for (cmd, name), values in samples.items()]
    print(format_stats_table(rows, "s", label="command / tree"))
    ratios = []
    for command in COMMANDS:
        base, ours = (samples[(command, name)] for name in trees)
        ratio = min_med_max(base)[1] / min_med_max(ours)[1]
        ratios.append((f"{command}: baseline / this tree (median)", ratio, "x faster"))
    print(format_ratios(ratios))
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [name for name, _, _ in rows]
    medians, errors = whiskers([values for _, values, _ in rows])
    ax.barh(labels, medians, xerr=errors, color=["#8c8c8c", "#ff7f0e"] * len(COMMANDS))
    ax.set_xlabel("seconds (median; whiskers min..max)")
    ax.set_title(f"tenantkv CLI start-up, {args.reps} runs each, load {load[0]:.1f}")
    save_figure(fig, args.out / "cli_startup.png")
    (args.out / "cli_startup.json").write_text(
        json.dumps({f"{c} / {n}": v for (c, n), v in samples.items()}, indent=2)
    )
    print(f"wrote {args.out / 'cli_startup.png'}")


if __name__ == "__main__":
    main()
