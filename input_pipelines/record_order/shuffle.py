"""A seeded permutation of [0, n), evaluated position by position.

A table of n shuffled record numbers would cost 8 bytes per record per
worker and a full pass to make; instead position k of epoch e maps to
`permute(k, n, key(seed, e))`, a keyed Feistel network on the smallest
power-of-four domain holding n, cycle-walked into [0, n) (Black and
Rogaway's construction; Grain's index shuffle is built the same way). It is a
bijection: every record once per epoch, whatever positions one asks about
and in whatever order, so each worker computes only its own positions.
"""

import numpy as np

ROUNDS = 6
_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a cheap, well-avalanching 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _scalar_mix(x: int) -> int:
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def epoch_key(seed: int, epoch: int) -> int:
    """The permutation key of one epoch of one seed (64 bits)."""
    return _scalar_mix(_scalar_mix(seed * 0x9E3779B97F4A7C15 + 1) + epoch)


def _round_keys(key: int):
    keys, k = [], key
    for _ in range(ROUNDS):
        k = _scalar_mix(k + 0x9E3779B97F4A7C15)
        keys.append(np.uint64(k))
    return keys


def permute(positions, n: int, key: int) -> np.ndarray:
    """Record numbers at `positions` (each in [0, n)) of the permutation
    named by `key`.

    Args:
        positions: Integer array-like of positions in [0, n).
        n: Records in the epoch (>= 1).
        key: From `epoch_key`.

    Returns:
        int64 array of record numbers, the same shape as `positions`.
    """
    x = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return np.zeros(x.shape, np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _round_keys(key)
    limit = np.uint64(n)

    def network(v):
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << shift) | right

    with np.errstate(over="ignore"):
        out = network(x)
        # Cycle walking: values outside [0, n) go round again; the domain is
        # under 4n, so a few rounds at most.
        outside = out >= limit
        while outside.any():
            out[outside] = network(out[outside])
            outside = out >= limit
    return out.astype(np.int64)
