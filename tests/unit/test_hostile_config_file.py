"""A ``--config-file`` that is not UTF-8 is refused in one line that names the file and where
the first byte that is not UTF-8 sits."""

from __future__ import annotations

import pytest

from syncdp.launch import cli, config_file


def test_a_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"params:\n  fusion_threshold_mb: 32  # caf\xe9 (Latin-1)\n")
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-np", "2", "--config-file", str(path), "python"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"syncdp-run: error: --config-file {path} is not UTF-8 text: byte 0xe9 at line 2, "
        "column 33; save it as UTF-8"
    ]


def test_utf8_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes("\ufeffparams:\n  fusion_threshold_mb: 32  # café\n".encode())
    contents = config_file.read(str(path))
    assert contents.flags == (("params.fusion_threshold_mb", ("--fusion-threshold-mb", "32")),)
