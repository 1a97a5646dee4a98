"""Horovod's gradient compression: what travels between the ranks."""

import tensorflow as tf


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Sends floating-point tensors as float16 (half the bytes); the sum is
    taken in float16, then cast back to the tensor's dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """`Compression.none` or `Compression.fp16`, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
