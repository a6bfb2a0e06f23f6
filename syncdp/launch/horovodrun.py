"""``horovodrun``: Horovod's command, answered by ``syncdp-run``, unless Horovod is installed.

``horovodrun -np 4 python train.py`` is how Horovod's users start every job. Installed with
syncdp, ``horovodrun`` takes horovodrun's whole command line (every flag ``syncdp-run`` takes:
:mod:`syncdp.launch.horovodrun_flags`) and does exactly what ``syncdp-run`` does with it; its
``--version`` says that syncdp answers.

Where Horovod itself is installed (its ``horovod`` package importable), this command hands the
command line to Horovod's own launcher unchanged, so installing syncdp beside Horovod never
changes what ``horovodrun`` runs; ``syncdp-run`` is then the way to run syncdp. If Horovod's
launcher cannot be imported, one line says so and the exit status is 1.
"""

from __future__ import annotations

import importlib
import sys

from syncdp import horovod_names
from syncdp.launch import cli, run

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``horovodrun``.

    Args:
        argv: The arguments after the program name. Defaults to ``sys.argv[1:]``.

    Returns:
        The exit status: ``syncdp-run``'s, or Horovod's launcher's where Horovod is installed.
    """
    if horovod_names.real_horovod() is not None:
        return _horovods_own(argv)
    return run.run(cli.parse_args(argv, prog="horovodrun"))


def _horovods_own(argv: list[str] | None) -> int:
    """Runs the installed Horovod's launcher on the same command line."""
    try:
        launcher = importlib.import_module("horovod.runner.launch")
    except Exception as e:  # noqa: BLE001 - any failure of a foreign package, named
        print(
            f"horovodrun: Horovod is installed ({horovod_names.real_horovod()}) but its "
            f"launcher cannot be imported ({type(e).__name__}: {e}); to run syncdp, use "
            "syncdp-run with the same arguments.",
            file=sys.stderr,
        )
        return 1
    if argv is not None:
        sys.argv[1:] = argv
    result = launcher.run_commandline()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
