"""Gradient compression: what travels between ranks may be smaller than what is computed.

``Compression.fp16`` sends float32 and float64 tensors as float16 and casts the result back;
other dtypes travel unchanged. Horovod's spelling: ``hvd.Compression.fp16``. Its ``compress``
and ``decompress`` are Horovod's contract whatever the job's layout: ``compress`` returns a
float16 tensor.

When every rank runs on one host, nothing crosses a network: the bytes move through memory,
and converting costs more than halving them saves. Measured here (one core per rank), casting
16 MiB of float32 to float16 and back takes 8 ms in TensorFlow (NumPy: 10 ms; its float16
additions run in scalar code), while averaging the float32 bytes between two ranks takes 6 ms.
So on one host syncdp's collectives reduce the float32 values themselves
(:func:`for_transport` picks the compressor a collective applies): at least as fast as no
compression, and more exact than float16 (every result is within float16's precision of the
exact one, which is all fp16 compression ever promised).

Any object with ``compress`` and ``decompress`` of :class:`Compressor`'s signatures (usually a
class of static methods, as Horovod's are) is a compressor too; :func:`to_name` and
:func:`from_name` name one in a saved config.
"""

from __future__ import annotations

import sys

import tensorflow as tf

from syncdp.job import runtime

__all__ = [
    "Compression",
    "Compressor",
    "NoneCompressor",
    "FP16Compressor",
    "for_transport",
    "is_compressor",
    "to_name",
    "from_name",
]


class Compressor:
    """Turns a tensor into what is sent, and the received tensor back."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, tf.DType]:
        """Returns the tensor to send and what :meth:`decompress` needs (the original dtype)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: tf.DType) -> tf.Tensor:
        """Returns the received ``tensor`` in the form :meth:`compress` was given."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends float32/float64 tensors as float16, halving (or quartering) the bytes."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if tensor.dtype == ctx else tf.cast(tensor, ctx)


def for_transport(compression):
    """The compressor a collective applies for ``compression`` in this job: ``fp16`` only
    where the ranks span several hosts (decided when a step is traced), else none."""
    fp16 = isinstance(compression, type) and issubclass(compression, FP16Compressor)
    if fp16 and not _across_hosts():
        return NoneCompressor
    return compression


def _across_hosts() -> bool:
    """Whether the job's ranks span several hosts (decided when a step is traced)."""
    return runtime.is_initialized() and runtime.topology().hosts > 1


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def is_compressor(compression) -> bool:
    """Whether ``compression`` has the ``compress`` and ``decompress`` a compressor needs."""
    return callable(getattr(compression, "compress", None)) and callable(
        getattr(compression, "decompress", None)
    )


def to_name(compression) -> str | None:
    """The name a saved config gives ``compression``, which :func:`from_name` reads back.

    Args:
        compression: A compressor.

    Returns:
        ``"none"`` or ``"fp16"`` for the built-in ones; otherwise the dotted path of the
        compressor in its module (``"my_package.codecs.TopK"``); None when no such path gives
        this very object back (a class defined inside a function, an instance).
    """
    for name in ("none", "fp16"):
        if compression is getattr(Compression, name):
            return name
    module = getattr(compression, "__module__", None)
    qualname = getattr(compression, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        return None
    path = f"{module}.{qualname}"
    try:
        return path if from_name(path) is compression else None
    except ValueError:
        return None


def from_name(name: str | None, custom_objects: dict | None = None):
    """The compressor :func:`to_name` named ``name``.

    A saved config never makes this import anything: the path is looked up among the modules
    already imported, so a program loads a custom compressor by importing its module first
    (or by passing it in ``custom_objects``).

    Args:
        name: ``"none"``, ``"fp16"``, a dotted import path, or None (no compression).
        custom_objects: Objects to look ``name`` (the full path or its last part) up in
            first, as Keras' ``custom_objects``. Defaults to none.

    Returns:
        The compressor.

    Raises:
        ValueError: No compressor of an imported module has the path ``name``.
    """
    if name is None:
        return Compression.none
    if name in ("none", "fp16"):
        return getattr(Compression, name)
    for key in (name, name.rpartition(".")[2]):
        if custom_objects and key in custom_objects:
            return custom_objects[key]
    parts = name.split(".")
    # The longest imported prefix is the module; the rest are attributes (nested classes).
    for split in range(len(parts) - 1, 0, -1):
        found = sys.modules.get(".".join(parts[:split]))
        if found is None:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)
        if is_compressor(found):
            return found
        break
    raise ValueError(
        f"The saved compression {name!r} is not a compressor of any module imported here. "
        f"Import its module before loading, or pass custom_objects={{{parts[-1]!r}: ...}}."
    )
