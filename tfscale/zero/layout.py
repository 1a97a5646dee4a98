"""ZeRO's flat layout (`zero/optimizer.py`): the trainable weights end to end in one
vector of P elements, padded to N x S, worker r owning elements
[r S, (r + 1) S); which piece of which variable lies in a shard, and the
reshapes between the variables, the flat vector and a shard."""

import math
from typing import List, NamedTuple, Sequence

import numpy as np
import tensorflow as tf


class Piece(NamedTuple):
    """The part of variable `variable` that lies in this worker's shard:
    its flat elements [start, stop), at `offset` in the shard."""

    variable: int
    start: int
    stop: int
    offset: int


class Layout:
    """Where each variable lies in the flat vector and which elements each
    of `num_shards` workers owns.

    Args:
        shapes: The trainable variables' shapes, in the model's order.
        num_shards: N, the workers.
        index: This worker's shard.
    """

    def __init__(self, shapes: Sequence, num_shards: int, index: int):
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = list(np.cumsum([0] + self.sizes[:-1]))
        self.total = sum(self.sizes)
        self.num_shards = num_shards
        self.index = index
        self.shard_size = max(1, math.ceil(self.total / num_shards))
        self.pieces = self.pieces_of(index)

    def pieces_of(self, index: int) -> List[Piece]:
        """The pieces of shard `index`, in variable order."""
        first = index * self.shard_size
        last = min(first + self.shard_size, self.total)
        pieces = []
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            lo, hi = max(first, offset), min(last, offset + size)
            if lo < hi:
                pieces.append(Piece(i, int(lo - offset), int(hi - offset),
                                    int(lo - first)))
        return pieces

    @property
    def padding(self) -> int:
        return self.num_shards * self.shard_size - self.total

    def flatten(self, tensors) -> tf.Tensor:
        """[N x S]: `tensors` (one per variable) end to end, zero-padded."""
        flats = [tf.reshape(t, [-1]) for t in tensors]
        if self.padding:
            flats.append(tf.zeros([self.padding], flats[0].dtype))
        return tf.concat(flats, axis=0)

    def split(self, shard) -> list:
        """This worker's [S] shard as its pieces (static slices)."""
        return [shard[p.offset:p.offset + p.stop - p.start]
                for p in self.pieces]

    def join(self, pieces, dtype=tf.float32) -> tf.Tensor:
        """The inverse of `split`: [S], zero beyond the last piece."""
        used = sum(p.stop - p.start for p in self.pieces)
        parts = list(pieces)
        if used < self.shard_size:
            parts.append(tf.zeros([self.shard_size - used], dtype))
        return tf.concat(parts, axis=0)

    def unflatten(self, flat) -> list:
        """The inverse of `flatten`: one tensor per variable, shaped."""
        parts = tf.split(flat[:self.total], self.sizes)
        return [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]
