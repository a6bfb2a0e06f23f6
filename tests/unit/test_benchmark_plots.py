"""The benchmarks write their tables and plots (ratios with their intervals), and skip their
plots, saying why, without matplotlib."""

import json
import sys

import pytest

from tests.launcher import ROOT


def test_a_plot_without_matplotlib_is_skipped_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    table = common.write_markdown("b", "B", ["np", "ratio"], [[2, "0.95"]])
    plot = common.plot_lines("b", "B", {"syncdp": ([2], [0.95])}, xlabel="np", ylabel="ratio")
    assert plot is None and not (tmp_path / "b.png").exists()
    assert table.read_text().count("| 2 | 0.95 |") == 1
    out = capsys.readouterr()
    assert "matplotlib is not installed" in out.out + out.err and "b.png" in out.out + out.err


def _breakdown_result(np_: int, ratios: dict) -> dict:
    """One np's figures as breakdown.py's worker sends them (through JSON: lists, not tuples)."""
    split = {"step_s": 0.17, "computing": 0.9, "waiting": 0.06, "moving": 0.04, "gbps": 1.2}
    result = {
        "np": np_,
        "model": "cnn",
        "mbytes": 8.8,
        "batch": 32,
        "steps": 5,
        "repeats": 20,
        "step_ms": {k: (160.0, 150.0, 170.0) for k in ("no communication", *ratios)},
        "ratio": ratios,
        "split": [split] * np_,
        "machine": "test machine",
    }
    return json.loads(json.dumps(result))


def test_breakdown_writes_each_ratio_with_its_interval(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import breakdown
    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(breakdown, "RESULTS", tmp_path)
    ratios = {
        "barrier": (0.95, 0.94, 0.96),
        "naive allreduce": (0.9, 0.85, 0.93),
        "syncdp": (1.02, 0.99, 1.15),  # an interval past 1.1 must still fit the plot
    }
    breakdown._write([_breakdown_result(2, ratios), _breakdown_result(3, ratios)])
    table = (tmp_path / "breakdown.md").read_text()
    row = "| 2 | 160.0 [150.0, 170.0] | 0.950 [0.940, 0.960] | 0.900 [0.850, 0.930] | "
    assert row + "1.020 [0.990, 1.150] |" in table
    assert "| np | no communication ms per step | barrier | naive allreduce | syncdp |" in table
    assert (tmp_path / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
