"""How tfscale.horovod's ranks agree on each collective before it runs.

Every collective first agrees with the other ranks on what is being done:
one `Allgather` of a fixed-size row (kind, name, reduction, dtype, root, a
checksum of the shapes, a sequence number), as Horovod's coordinator does.
Ranks that pass different shapes, dtypes or collectives then all raise the
same one-line error naming the op, the ranks and their shapes, instead of
hanging or crashing inside MPI; the row also carries `join()`'s "no more
data" flag. Horovod's reduction constants live here too (`ops` re-exports
them).
"""

import zlib
from typing import Optional, Sequence

import numpy as np

# Horovod's reduction constants (the same values as horovod.tensorflow's).
Average = 0


Sum = 1


Adasum = 2


Min = 3


Max = 4


Product = 5


OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min",
             Max: "Max", Product: "Product"}


ALLREDUCE, ALLGATHER, BROADCAST, JOIN = 1, 2, 3, 4


KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather",
               BROADCAST: "broadcast", JOIN: "join"}


# A row: kind, op, dtype, root, tensors, checksum of the shapes that must
# agree, the first dimension (allgather), the collective's sequence number,
# checksum of its name (as Horovod's coordinator matches ops by name).
ROW = 9


MUST_AGREE = [0, 1, 2, 3, 4, 5, 8]


class CollectiveMismatchError(ValueError):
    """Ranks issued different collectives, or passed different tensors."""


def describe(dtype, shape) -> str:
    return f"{np.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def checksum(parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


# With TFSCALE_HOROVOD_CHECK=first: how many calls of each name agree
# before the rest of that name's calls go unchecked.
FIRST_CHECKS = 3


def trusted(state, kind: int, name: str) -> bool:
    """Whether this allreduce or broadcast may skip the agreement (mode
    "first", and its name agreed FIRST_CHECKS times already). Every rank
    decides alike: the counts only grow on calls that agreed everywhere."""
    if state.check != "first" or kind not in (ALLREDUCE, BROADCAST):
        return False
    key = (kind, name)
    seen = state.checked.get(key, 0)
    if seen >= FIRST_CHECKS:
        state.sequence += 1
        return True
    state.checked[key] = seen + 1
    return False


def agree(state, kind: int, name: str, shapes: Sequence[tuple], dtype,
           op: int = 0, root: int = 0) -> Optional[np.ndarray]:
    """Exchanges this rank's row with every rank's; returns the table (None
    when the call is trusted without it: `trusted`).

    Raises:
        CollectiveMismatchError: (on every rank) the ranks disagree.
    """
    if trusted(state, kind, name):
        return None
    state.sequence += 1
    if kind == ALLGATHER:
        must_agree = [tuple(s[1:]) for s in shapes]
        first = shapes[0][0] if shapes and shapes[0] else 1
    else:
        must_agree = [tuple(s) for s in shapes]
        first = 0
    dtype_code = checksum(np.dtype(dtype).name) if dtype is not None else 0
    row = np.array([kind, op, dtype_code, root, len(shapes),
                    checksum(must_agree), first, state.sequence,
                    checksum(name)], np.int64)
    table = np.empty((state.size, ROW), np.int64)
    state.comm.Allgather(row, table)
    joined = table[:, 0] == JOIN
    active = table[~joined]
    if joined.any() and len(active):
        if np.any(active[:, 0] != ALLREDUCE):
            bad = int(active[active[:, 0] != ALLREDUCE][0, 0])
            raise CollectiveMismatchError(
                f"tfscale.horovod: {KIND_NAMES.get(bad, '?')} after a rank "
                "called join(): only allreduce (Sum or Average) runs while "
                "ranks have joined")
        if np.any(active[:, 1] != Sum):
            raise CollectiveMismatchError(
                "tfscale.horovod: allreduce with Min, Max or Product after a "
                "rank called join(): joined ranks add zeros, so only Sum and "
                "Average are defined")
    if np.any(table[:, 7] != table[0, 7]):
        behind = int(np.argmin(table[:, 7]))
        ahead = int(np.argmax(table[:, 7]))
        raise CollectiveMismatchError(
            f"tfscale.horovod: rank {ahead} is at collective "
            f"{int(table[ahead, 7])}, rank {behind} at "
            f"{int(table[behind, 7])} (a rank re-initialized, or left a "
            "collective half-done)")
    keys = active[:, MUST_AGREE]
    if len(keys) and np.any(keys != keys[0]):
        ranks = np.flatnonzero(~joined)
        differs = np.flatnonzero(np.any(keys != keys[0], axis=1))
        _raise_mismatch(state, int(ranks[0]), int(ranks[differs[0]]), kind,
                        name, shapes, dtype, op, root)
    return table


def _raise_mismatch(state, first, other, kind, name, shapes, dtype, op,
                    root):
    """Gathers every rank's description and raises the same error on all,
    naming rank `first` and the first rank `other` that differs from it."""
    mine = (KIND_NAMES[kind], name, OP_NAMES.get(op, "?"), root,
            [describe(dtype, s) for s in shapes])
    everyone = state.comm.allgather(mine)
    reference, theirs = everyone[first], everyone[other]

    def said(rank, d):
        kind_name, op_name, tensors = d[0], d[1], d[4]
        shown = tensors[0] if len(tensors) == 1 else f"[{', '.join(tensors)}]"
        return f"rank {rank} called {kind_name} {op_name!r} with {shown}"

    if reference[0] != theirs[0] or reference[1] != theirs[1]:
        detail = (f"{said(first, reference)}, {said(other, theirs)} (every "
                  "rank must issue the same collectives, by name, in the "
                  "same order)")
    elif reference[4] != theirs[4]:
        detail = (f"{said(first, reference)}, {said(other, theirs)} (every "
                  "rank must pass the same shapes and dtypes"
                  + (", except allgather's first dimension)"
                     if kind == ALLGATHER else ")"))
    elif reference[2] != theirs[2]:
        detail = (f"rank {first} reduces with op={reference[2]}, rank "
                  f"{other} with op={theirs[2]}")
    else:
        detail = (f"rank {first} broadcasts from root {reference[3]}, rank "
                  f"{other} from root {theirs[3]}")
    raise CollectiveMismatchError(
        f"tfscale.horovod: mismatched {reference[0]} {reference[1]!r}: "
        f"{detail}")


def watched(state):
    return state.watchdog if state.watchdog is not None else _NoWatch()


class _NoWatch:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
