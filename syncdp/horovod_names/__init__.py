"""Horovod's import names, answered by syncdp: ``import horovod.tensorflow as hvd`` runs unchanged.

A Horovod program imports ``horovod``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``,
``horovod.keras``, their ``elastic`` and ``callbacks`` modules, and a few helpers
(``horovod.common.util``, ``horovod.tensorflow.util``, ``horovod.tensorflow.mpi_ops``, ...),
and calls ``horovod.run(func, ...)`` (also ``horovod.runner.run``), which syncdp's launcher
answers (:mod:`syncdp.launch.run_func`); ``python -m horovod.runner.launch`` is ``horovodrun``.
:class:`HorovodNames` is an import hook that answers those names with syncdp's modules
themselves (``horovod.tensorflow`` *is* ``syncdp.tensorflow``: the same module object, so there
is one set of classes and one runtime whichever name a program uses).

It never shadows a real Horovod: the hook sits first in ``sys.meta_path`` but answers
``horovod`` only after asking every other finder, and answers ``horovod.*`` only while the
``horovod`` in ``sys.modules`` is its own. Where Horovod itself is installed (a ``horovod``
package with Horovod's launcher, ``horovod/runner``, on ``sys.path``), that one is imported and
syncdp stays out of the way. A folder that merely has the name (a user's ``horovod/`` beside
the script, with no ``__init__.py``: what Python would import as an empty namespace package)
is not Horovod, and syncdp answers.

The hook is installed at interpreter start by the ``syncdp-horovod.pth`` file that
``pip install`` puts in site-packages, so it works for a plain ``python train.py`` as well as
for ranks started by ``horovodrun`` or ``syncdp-run``. Every Python start pays for it, so this
module imports only what the interpreter has already loaded by then (no ``importlib.abc``,
which on Python 3.11 pulls in ``importlib.resources``, ``pathlib`` and ``tempfile``), and
loads neither TensorFlow nor MPI.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys

__all__ = [
    "HorovodNames",
    "install",
    "installed",
    "real_horovod",
    "horovod_api_version",
    "MODULES",
]

# The Horovod release whose API syncdp speaks; horovod.__version__ is this plus syncdp's own.
horovod_api_version = "0.28.1"

# Horovod's module name -> the syncdp module that answers it (None: a package of its own).
MODULES: dict[str, str | None] = {
    "horovod": None,
    "horovod.common": None,
    "horovod.common.util": "syncdp.horovod_names.util",
    "horovod.common.exceptions": "syncdp.base.errors",
    "horovod.common.process_sets": "syncdp.job.process_sets",
    "horovod.common.elastic": "syncdp.elastic",
    "horovod.runner": None,
    "horovod.runner.launch": "syncdp.launch.horovodrun",
    "horovod.runner.util": None,
    "horovod.runner.util.threads": "syncdp.horovod_names.threads",
    "horovod.tensorflow.mpi_ops": "syncdp.tensorflow",
    "horovod.tensorflow.functions": "syncdp.tensorflow",
    "horovod.tensorflow.gradient_aggregation": "syncdp.tensorflow",
    "horovod.tensorflow.gradient_aggregation_eager": "syncdp.tensorflow",
}
# Names of these (otherwise empty) packages that syncdp's launcher answers, imported on first use:
# horovod.run(func, ...) is Horovod's programmatic launcher.
_LAUNCHER_NAMES = {
    "horovod": {"run": "syncdp.launch.run_func"},
    "horovod.runner": {"run": "syncdp.launch.run_func"},
}
# Horovod's packages whose every module has the same name under syncdp.
_PREFIXES = {"horovod.tensorflow": "syncdp.tensorflow", "horovod.keras": "syncdp.keras"}
_MARK = "__syncdp__"
ModuleType = type(sys)  # types.ModuleType, without importing types at every interpreter start


def _target(fullname: str) -> str | None:
    """The syncdp module that answers Horovod's ``fullname``; raises ModuleNotFoundError."""
    if fullname in MODULES:
        return MODULES[fullname]
    for horovod_name, syncdp_name in _PREFIXES.items():
        if fullname == horovod_name or fullname.startswith(horovod_name + "."):
            return syncdp_name + fullname[len(horovod_name) :]
    raise ModuleNotFoundError(
        f"No module named {fullname!r}: syncdp answers Horovod's TensorFlow and Keras modules "
        f"({', '.join(sorted(_PREFIXES))}, horovod.common.util ...), not this one",
        name=fullname,
    )


class HorovodNames:
    """The import hook (a meta path finder and its loader, by the protocol the import system
    calls: ``find_spec``, ``create_module``, ``exec_module``): see the module's docstring."""

    def __init__(self):
        self._found: dict[str, ModuleType] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        if fullname == "horovod":
            if self._another_horovod():
                return None
        elif not getattr(sys.modules.get("horovod"), _MARK, False):
            return None  # a real Horovod's submodule: not ours to answer
        module = self._found[fullname] = _answer(fullname)
        return importlib.machinery.ModuleSpec(
            fullname, self, is_package=hasattr(module, "__path__")
        )

    def _another_horovod(self) -> bool:
        return real_horovod() is not None

    def create_module(self, spec):
        return self._found.pop(spec.name)

    def exec_module(self, module):
        pass  # the module is syncdp's, already executed (or an empty package)

    def get_code(self, fullname):
        """What ``python -m horovod.X`` runs (``runpy`` asks the loader): the code of the
        syncdp module that answers ``horovod.X``; None for an empty package."""
        name = _target(fullname)
        if name is None:
            return None
        return importlib.import_module(name).__spec__.loader.get_code(name)


def _answer(fullname: str) -> ModuleType:
    """The module that answers Horovod's ``fullname``: syncdp's, or an empty package."""
    name = _target(fullname)
    if name is not None:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # something the module itself imports is missing
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: syncdp, which answers Horovod's names here, "
                f"has no {name}",
                name=fullname,
            ) from None
    doc = f"{fullname}: Horovod's name, answered by syncdp (syncdp.horovod_names)."
    module = ModuleType(fullname, doc)
    module.__path__ = []
    setattr(module, _MARK, True)
    if fullname in _LAUNCHER_NAMES:
        module.__getattr__ = _from_launcher(fullname, _LAUNCHER_NAMES[fullname])
    if fullname == "horovod":
        from syncdp import __version__

        module.__version__ = f"{horovod_api_version}+syncdp.{__version__}"
        if "tensorflow" in sys.modules:  # Keras 2's spellings before the program reads them
            importlib.import_module("syncdp.tensorflow.keras2_names").install()
    return module


def _from_launcher(package: str, names: dict[str, str]):
    """A module ``__getattr__`` that imports ``names`` (name -> syncdp launcher module) when
    first read, so that ``import horovod`` loads nothing of the launcher."""

    def get(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    return get


def real_horovod() -> str | None:
    """Where Horovod is installed (its package's ``__init__.py``), or None where only syncdp
    answers.

    Horovod is what another finder of ``sys.meta_path`` would import as ``horovod``, provided
    it is a regular package holding Horovod's launcher (``horovod/runner``, which ``horovodrun``
    runs). A namespace package (a folder named ``horovod`` without ``__init__.py``) or a module
    of that name is not Horovod.
    """
    for finder in sys.meta_path:
        if isinstance(finder, HorovodNames) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec("horovod", None)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.origin is None or not spec.submodule_search_locations:
            return None  # a namespace package or a plain module: the first found is imported
        if any(os.path.isdir(os.path.join(d, "runner")) for d in spec.submodule_search_locations):
            return spec.origin
        return None
    return None


def installed() -> HorovodNames | None:
    """The hook in ``sys.meta_path``, or None."""
    return next((f for f in sys.meta_path if isinstance(f, HorovodNames)), None)


def install() -> HorovodNames:
    """Puts the hook first in ``sys.meta_path`` (once); returns it."""
    hook = installed()
    if hook is None:
        hook = HorovodNames()
        sys.meta_path.insert(0, hook)
    return hook
