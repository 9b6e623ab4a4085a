"""The peer benchmark's per-round ratios (``bench/peers/report.py``): a target's ratio in each
round pairs a system with LMCache timed in the same rounds -- its own group's, when the systems
were timed in groups (LMCache runs in every group) -- and counts the rounds that meet."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

REPORT = Path(__file__).resolve().parent.parent / "bench" / "peers" / "report.py"


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers_report", REPORT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


report = _load_report()


def _system(name: str, seconds: list[float]) -> SimpleNamespace:
    return SimpleNamespace(name=name, note="", seconds=seconds)


def test_one_group_pairs_round_by_round() -> None:
    tkv = _system("tenantkv", [1.0, 2.0, 3.0])
    run = SimpleNamespace(groups=[["tenantkv", "LMCache"]])
    assert report.round_values(run, tkv, [10.0, 20.0, 30.0]) == [10.0, 20.0, 30.0]


def test_groups_pair_with_the_baseline_of_the_systems_own_group() -> None:
    # LMCache was timed in both groups, three rounds each; tenantkv only in the second.
    tkv = _system("tenantkv", [1.0, 2.0, 3.0])
    raw = _system("raw", [4.0, 5.0, 6.0])
    run = SimpleNamespace(groups=[["raw", "LMCache"], ["tenantkv", "LMCache"]])
    baseline = [10.0, 11.0, 12.0, 20.0, 21.0, 22.0]
    assert report.round_values(run, tkv, baseline) == [20.0, 21.0, 22.0]
    assert report.round_values(run, raw, baseline) == [10.0, 11.0, 12.0]


def test_rounds_that_cannot_be_paired_give_no_per_round_figures() -> None:
    tkv = _system("tenantkv", [1.0, 2.0, 3.0])
    run = SimpleNamespace(groups=[["tenantkv", "LMCache"], ["raw", "LMCache"]])
    assert report.round_values(run, tkv, [10.0, 20.0]) == []
    assert report.per_round([], lambda r: True) == "-"


def test_per_round_counts_the_rounds_that_meet() -> None:
    ratios = [0.09, 0.12, 0.1, 0.2]
    assert report.per_round(ratios, lambda r: r <= 0.1) == "0.090-0.200, 2 of 4 meet"
    assert report.per_round(ratios, lambda r: r >= 1) == "0.090-0.200, 0 of 4 meet"


def test_a_rewrite_keeps_the_other_benchmarks_sections(tmp_path: Path) -> None:
    """peers.py rewrites BENCHMARKS.md; the engines' sections after the marker stay."""
    path = tmp_path / "BENCHMARKS.md"
    assert report.kept_sections(path) == ""  # no file yet
    path.write_text("# old peers figures\n\nno marker\n", encoding="utf-8")
    assert report.kept_sections(path) == ""
    engines = f"{report.KEPT_MARKER}\n\n## vLLM on CPU\n\n| a | b |\n"
    path.write_text("# old peers figures\n\n" + engines, encoding="utf-8")
    assert report.kept_sections(path) == "\n" + engines
