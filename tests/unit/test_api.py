"""The public API is declared: __all__ matches what the packages export, Horovod's names exist;
every module imports, and the modules' imports form no cycle and never run up from the core."""

import ast
import importlib
import pathlib

import pytest
import tensorflow as tf

import syncdp

HOROVOD_NAMES = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_chief",
    "barrier",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "broadcast_object",
    "allgather_object",
    "join",
    "Average",
    "Sum",
    "Compression",
    "DistributedGradientTape",
]


@pytest.mark.parametrize("module", ["syncdp", "syncdp.tensorflow"])
def test_horovod_names_are_exported(module):
    mod = importlib.import_module(module)
    for name in HOROVOD_NAMES:
        assert name in mod.__all__, name
        assert getattr(mod, name) is getattr(syncdp, name), name
    assert mod.Compression.none is not None and mod.Compression.fp16 is not None


def test_all_matches_public_names():
    public = {n for n in dir(syncdp) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(syncdp, n)).__name__ == "module"}
    assert set(syncdp.__all__) == public - submodules


@pytest.mark.parametrize(
    "call",
    [
        lambda: syncdp.rank(),
        lambda: syncdp.size(),
        lambda: syncdp.local_rank(),
        lambda: syncdp.allreduce(tf.ones(2)),
        lambda: syncdp.allgather(tf.ones(2)),
        lambda: syncdp.broadcast(tf.ones(2), 0),
        lambda: syncdp.barrier(),
        lambda: syncdp.broadcast_object(1),
        lambda: syncdp.allgather_object(1),
    ],
)
def test_collectives_before_init_raise_clearly(call):
    syncdp.shutdown()  # whatever ran before in this process, start uninitialized
    assert not syncdp.is_initialized()
    with pytest.raises(syncdp.NotInitializedError, match=r"call syncdp.init\(\) first"):
        call()


@pytest.mark.parametrize(
    "name", ["rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"]
)
def test_before_init_horovods_except_value_error_catches_it(name):
    # Horovod raises ValueError("Horovod has not been initialized; use hvd.init().") here.
    syncdp.shutdown()
    try:
        getattr(syncdp, name)()
    except ValueError as caught:
        assert isinstance(caught, syncdp.NotInitializedError)
        assert isinstance(caught, RuntimeError)  # what syncdp raised before, still caught
    else:
        raise AssertionError(f"syncdp.{name}() before init() raised nothing")


# The module graph, read from the source: every `import` and `from ... import` anywhere in a
# module (also inside functions: an import run later still ties the two modules together).
SOURCE = pathlib.Path(syncdp.__file__).resolve().parent


def _module_names() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = ["syncdp", *path.relative_to(SOURCE).with_suffix("").parts]
        if parts[-1] == "__main__":
            continue  # a program (python -m syncdp.launch): importing it runs it
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _module_names()


def _imports(path: pathlib.Path) -> set[str]:
    """The syncdp modules ``path`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.add(sub if sub in MODULES else node.module)
    return {n for n in names if n in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_the_rooms_below_the_engine_import_no_higher_layer():
    higher = ("syncdp.engine", "syncdp.tensorflow", "syncdp.keras")
    below = tuple(f"syncdp.{room}." for room in ("base", "watch", "transport", "membership", "job"))
    for name, imported in GRAPH.items():
        if name.startswith(below):
            up = sorted(m for m in imported if m.startswith(higher))
            assert not up, f"{name} imports {up}: hand it a callable (a hook) instead"


def test_no_two_modules_import_each_other_nor_any_cycle():
    # Depth-first search; a module met again while it is still being explored closes a cycle.
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name) :] + [name]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}; hand a callable down instead")
        if name in done:
            return
        path.append(name)
        for other in sorted(GRAPH[name]):
            visit(other)
        path.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)


def test_the_tensorflow_face_hands_a_keras_optimizer_to_the_keras_face_it_never_imports():
    import subprocess
    import sys

    program = """
import sys
import keras
import syncdp.tensorflow as hvd
assert "syncdp.keras" not in sys.modules  # importing the TensorFlow face loads no Keras face

class Mine(keras.optimizers.SGD):  # a user's subclass, from a module that is not Keras'
    pass

opt = hvd.DistributedOptimizer(Mine(0.1), backward_passes_per_step=2)
import syncdp.keras
assert type(opt) is syncdp.keras.DistributedOptimizer, type(opt)
assert isinstance(opt.inner_optimizer, Mine) and opt.backward_passes_per_step == 2
try:
    hvd.DistributedOptimizer("sgd")
except ValueError as e:
    assert "a Keras optimizer (Keras 3, or tf-keras" in str(e)
else:
    raise AssertionError("a string was taken for an optimizer")
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_reduce_ops_are_horovods_numbers():
    """Horovod's ops are the integers of its C++ enum: programs compare them with numbers,
    store them as numbers (JSON), and pass numbers back."""
    import json

    import syncdp.tensorflow as hvd

    numbers = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}
    for name, number in numbers.items():
        op = getattr(hvd, name)
        assert op == number and hvd.ReduceOp(number) is op
        assert hvd.collectives.reduce_op(number) is op  # what every op= argument reads
    assert json.loads(json.dumps({"op": hvd.Sum})) == {"op": 1}
    assert f"{hvd.Min}" == str(hvd.Min) == "ReduceOp.MIN"  # messages name the op
    for bad in (6, -1, True, "sum"):
        with pytest.raises(ValueError):
            hvd.collectives.reduce_op(bad)
