"""Layers import one way: base <- watch <- transport <- membership <- job <- engine <- elastic <-
tensorflow <- data <- checkpoint <- keras <- horovod_names (Horovod's import names, answered by
every layer below) <- launch (the launcher, ``syncdp-run``, which starts and watches the ranks
from outside them). The folders follow the data's way, from who a rank is to the Keras face.

Read from the source (no import needed): a module may import syncdp modules of its own layer
or lower ones, never higher. The Horovod-path alias ``syncdp.tensorflow.keras`` (a re-export
of the Keras face, like Horovod's), the package's own ``__init__`` (the public surface) and the
TensorFlow face's ``__init__`` (Horovod's ``hvd.DistributedOptimizer`` hands a Keras optimizer
to the Keras face, as Horovod's does, importing it only then) are the exceptions.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "syncdp"
# syncdp/elastic.py is the framework-neutral elastic state and loop; the TensorFlow and Keras
# states build on it.
LAYERS = [
    "base",
    "watch",
    "transport",
    "membership",
    "job",
    "engine",
    "elastic",
    "tensorflow",
    "data",
    "checkpoint",
    "keras",
    "horovod_names",
    "launch",
]
EXEMPT = {
    "__init__.py",
    "tensorflow/__init__.py",
    "tensorflow/keras/__init__.py",
}


def _layer(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "syncdp"
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def _files():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in EXEMPT:
            yield rel, path


@pytest.mark.parametrize("rel, path", list(_files()), ids=lambda v: str(v))
def test_imports_point_down(rel, path):
    own = _layer("syncdp." + rel.removesuffix(".py").replace("/", "."))
    assert own >= 0, f"{rel} is in no layer: put it under one of {LAYERS}"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module == "syncdp":
            names = [f"syncdp.{a.name}" for a in node.names]  # from syncdp import engine
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("syncdp.") and _layer(name) >= 0:
                assert _layer(name) <= own, f"{rel} (layer {LAYERS[own]}) imports {name}"
            else:
                assert name != "syncdp", f"{rel} imports the whole package; import its layer"


def test_the_rooms_below_tensorflow_import_no_tensorflow_at_module_level():
    # The launcher too: syncdp-run and each rank's supervisor start without TensorFlow.
    for layer in ("base", "watch", "transport", "membership", "job", "engine", "launch"):
        for path in (ROOT / layer).glob("*.py"):
            tree = ast.parse(path.read_text())
            for node in tree.body:  # module level only: init() may import TensorFlow lazily
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = (
                        [node.module or ""]
                        if isinstance(node, ast.ImportFrom)
                        else [a.name for a in node.names]
                    )
                    assert not any(n.split(".")[0] in ("tensorflow", "keras") for n in names), (
                        f"{path.name} imports {names}"
                    )
