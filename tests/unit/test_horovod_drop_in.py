"""Horovod's names after the README's install: ``import horovod...`` and ``horovodrun``.

Each check runs a fresh ``python`` (the hook is installed at interpreter start by the
``syncdp-horovod.pth`` file in site-packages) with nothing added to its path, as a plain
``python train.py`` would run. Where another ``horovod`` package is importable (a fake one on
``PYTHONPATH`` stands for a real Horovod), that one is imported and ``horovodrun`` runs its
launcher.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.launcher import ROOT, rank_env


def _python(code: str, env: dict[str, str] | None = None, cwd=None):
    full = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    full.pop("PYTHONPATH", None)
    full.update({k: v for k, v in (env or {}).items()})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
        cwd=cwd or "/",
    )


def test_horovod_names_are_syncdps_own_modules():
    result = _python(
        """
        import horovod, syncdp
        import horovod.tensorflow as hvd
        import horovod.tensorflow.keras as hvd_keras
        import horovod.keras, horovod.keras.callbacks, horovod.keras.elastic
        import horovod.tensorflow.elastic, horovod.tensorflow.keras.callbacks
        import horovod.tensorflow.keras.elastic
        from horovod.tensorflow.util import _executing_eagerly
        from horovod.tensorflow.functions import broadcast_variables
        from horovod.tensorflow.mpi_ops import allreduce, size_op
        from horovod.tensorflow.compression import Compression
        from horovod.common.util import is_version_greater_equal_than, check_extension
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
        import syncdp.tensorflow, syncdp.keras, syncdp.tensorflow.keras, syncdp.keras.callbacks

        assert hvd is syncdp.tensorflow and hvd_keras is syncdp.tensorflow.keras
        assert horovod.keras is syncdp.keras
        assert horovod.keras.callbacks is syncdp.keras.callbacks
        assert horovod.tensorflow.keras.callbacks is syncdp.keras.callbacks
        assert horovod.tensorflow.elastic is syncdp.tensorflow.elastic
        assert broadcast_variables is hvd.broadcast_variables and allreduce is hvd.allreduce
        assert Compression is hvd.Compression and _executing_eagerly()
        assert HorovodInternalError is syncdp.base.errors.RankFailureError
        assert is_version_greater_equal_than("2.21.0", "2.6.0")
        assert not is_version_greater_equal_than("2.5.9", "2.6.0")
        assert horovod.__version__.startswith("0.28.1+syncdp."), horovod.__version__
        assert not hasattr(syncdp.tensorflow.util, "__path__")  # syncdp's modules untouched
        for name in ("horovod.torch", "horovod.tensorflow.nonexistent"):
            try:
                __import__(name)
            except ModuleNotFoundError as e:
                assert name in str(e) and "syncdp" in str(e), e
            else:
                raise AssertionError(name + " was imported")
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture
def fake_horovod(tmp_path):
    """A minimal package named horovod, with a launcher, on a folder for PYTHONPATH."""
    pkg = tmp_path / "site" / "horovod"
    (pkg / "runner").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.fake"\n')
    (pkg / "runner" / "__init__.py").write_text("")
    (pkg / "runner" / "launch.py").write_text(
        "import sys\n\ndef run_commandline():\n    print('fake horovodrun', sys.argv[1:])\n"
    )
    return tmp_path / "site"


def test_a_real_horovod_is_imported_and_left_alone(fake_horovod):
    result = _python(
        """
        import horovod
        assert horovod.__version__ == "0.0.fake", horovod.__version__
        try:
            import horovod.tensorflow
        except ModuleNotFoundError as e:
            assert "syncdp" not in str(e), e  # Python's own error: syncdp stayed out of it
        else:
            raise AssertionError("syncdp answered a submodule of another horovod")
        print("ok")
        """,
        env={"PYTHONPATH": str(fake_horovod)},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("contents", ["empty", "module", "package"])
def test_a_folder_named_horovod_is_not_horovod(tmp_path, contents):
    # A user's horovod/ beside the script (no __init__.py: a namespace package to Python), a
    # horovod.py, or a package of that name without Horovod's launcher: syncdp answers.
    if contents == "module":
        (tmp_path / "horovod.py").write_text("raise AssertionError('the wrong horovod')\n")
    else:
        (tmp_path / "horovod").mkdir()
        (tmp_path / "horovod" / "notes.txt").write_text("my experiments\n")
        if contents == "package":
            (tmp_path / "horovod" / "__init__.py").write_text("raise AssertionError('wrong')\n")
    result = _python(
        """
        import horovod.tensorflow as hvd
        import syncdp.tensorflow
        from syncdp import horovod_names

        assert hvd is syncdp.tensorflow and horovod_names.real_horovod() is None
        print("ok")
        """,
        cwd=tmp_path,  # python -c puts the working directory first on sys.path
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    version = subprocess.run(
        [_horovodrun(), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
    )
    assert version.returncode == 0 and "Horovod is not installed" in version.stdout, (
        version.stdout + version.stderr
    )


def _horovodrun():
    found = shutil.which("horovodrun")
    if found is None:
        pytest.fail("horovodrun is not on PATH: install syncdp as the README says")
    return found


def test_horovodrun_hands_a_real_horovod_its_command_line(fake_horovod):
    env = dict(os.environ, PYTHONPATH=str(fake_horovod))
    run = subprocess.run(
        [_horovodrun(), "-np", "2", "python", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fake horovodrun ['-np', '2', 'python', 'train.py']"


def test_horovodrun_is_syncdp_run_and_says_so():
    version = subprocess.run(
        [_horovodrun(), "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert version.returncode == 0 and "from syncdp" in version.stdout
    assert "Horovod is not installed" in version.stdout


@pytest.mark.parametrize("controller", ["--gloo", "--jsrun"])
def test_horovodrun_with_another_controller_runs_on_syncdps_engine(controller, tmp_path):
    # Horovod's elastic mode defaults to --gloo; the job is syncdp's, and one line says so.
    program = tmp_path / "train.py"
    program.write_text(
        "import tensorflow as tf\n"
        "import horovod.tensorflow as hvd\n"
        "hvd.init()\n"
        "total = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum)\n"
        "print('SUM', int(total.numpy()[0]), hvd.size(), flush=True)\n"
    )
    done = subprocess.run(
        [_horovodrun(), "-np", "2", controller, sys.executable, str(program)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=rank_env({"TF_CPP_MIN_LOG_LEVEL": "3"}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("SUM 1 2") == 2, done.stdout[-3000:]  # 0 + 1 on both ranks
    said = [line for line in done.stderr.splitlines() if controller in line]
    assert len(said) == 1 and "runs on syncdp's engine" in said[0], done.stderr[-3000:]


def test_horovods_test_helpers_and_keras_2s_version_are_there():
    # Horovod's test utilities start threads with horovod.runner.util.threads.in_thread, and
    # its Keras 2 tests read tf.keras.__version__ (tf-keras's API module has none of its own).
    pytest.importorskip("tf_keras")
    result = _python(
        """
        import threading
        import tensorflow as tf
        from tensorflow import keras
        import horovod
        import tf_keras
        from horovod.runner.util.threads import in_thread, on_event

        assert keras.__version__ == tf_keras.__version__, keras.__version__
        seen = []
        in_thread(seen.append, args=(1,)).join(10)
        event = threading.Event()
        waiter = on_event(event, seen.append, args=(2,), check_interval_seconds=0.05)
        event.set()
        waiter.join(10)
        assert seen == [1, 2], seen
        print("ok")
        """,
        env={"TF_USE_LEGACY_KERAS": "1"},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_horovods_common_helpers_and_version_error_are_there():
    result = _python(
        """
        import warnings
        from horovod.common.util import (
            extension_available, get_average_backwards_compatibility_fun, get_ext_suffix,
            gpu_available, is_iterable, num_rank_is_power_2,
        )
        from horovod.common.exceptions import HorovodVersionMismatchError
        import horovod.tensorflow as hvd
        import syncdp.base.errors as errors

        op_of = get_average_backwards_compatibility_fun(hvd)
        assert op_of(None, None) is hvd.Average and op_of(hvd.Sum, None) is hvd.Sum
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert op_of(None, False) is hvd.Sum
        assert [w.category for w in caught] == [DeprecationWarning]
        try:
            op_of(hvd.Sum, True)
        except ValueError:
            pass
        else:
            raise AssertionError("op and average together were taken")
        assert extension_available("horovod.tensorflow") and extension_available("horovod.keras")
        assert not extension_available("horovod.torch")
        assert not gpu_available("horovod.tensorflow")  # the collectives run on the host
        assert is_iterable([1]) and not is_iterable(3)
        assert [n for n in range(9) if num_rank_is_power_2(n)] == [1, 2, 4, 8]
        assert get_ext_suffix().endswith(".so")
        e = HorovodVersionMismatchError("tensorflow", "2.21.0", "2.15.0")
        assert isinstance(e, ImportError) and isinstance(e, errors.SyncdpError)
        assert (e.name, e.version, e.installed_version) == ("tensorflow", "2.21.0", "2.15.0")
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_pth_file_is_silent_when_syncdp_is_gone_and_installs_the_names_otherwise(tmp_path):
    """Python runs the .pth line at every start: a checkout removed under an editable install
    (syncdp no longer importable) must not print a traceback at every start."""
    shutil.copy(os.path.join(ROOT, "syncdp-horovod.pth"), tmp_path)
    site_dir = str(tmp_path)
    # -I -S: no site-packages, no PYTHONPATH, so syncdp is importable only where put on the path
    gone = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import site; site.addsitedir({site_dir!r})"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 0 and gone.stderr == "", gone.stderr
    present = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); import site;"
            f" site.addsitedir({site_dir!r}); import syncdp.horovod_names as names;"
            " print(names.installed() is not None)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert present.stdout.strip() == "True" and present.stderr == "", present.stderr
