"""The benchmarks write their tables and skip their plots, saying why, without matplotlib."""

import sys

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
