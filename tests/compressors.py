"""A compressor of a user's, for the tests that pass one where syncdp takes a compressor.

At module level, so a saved Keras config names it by its dotted path
(``tests.compressors.QuarterCompressor``) and loading finds it again.
"""

import tensorflow as tf

from syncdp.tensorflow.compression import Compressor


class QuarterCompressor(Compressor):
    """Sends values rounded to quarters (a lossy compressor the result can be checked by)."""

    @staticmethod
    def compress(tensor):
        return tf.round(tensor * 4) / 4, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
