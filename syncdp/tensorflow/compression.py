"""Gradient compression: what travels between ranks may be smaller than what is computed.

``Compression.fp16`` sends float32 and float64 tensors as float16 and casts the result back;
other dtypes travel unchanged. Horovod's spelling: ``hvd.Compression.fp16``.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


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


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
