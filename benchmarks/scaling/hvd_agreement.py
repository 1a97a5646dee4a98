r"""What tfscale.horovod's argument check costs on small tensors.

    tfscale-run -np 2 -H localhost:2 python -m benchmarks.scaling.hvd_agreement \
        [--repeats 3] [--calls 300]

Every `hvd.allreduce` first exchanges one small row per rank (kind, name,
dtype, shapes...: `tfscale/horovod/ops.py`) so that ranks that disagree fail
with one line instead of hanging. This measures, in one run, interleaved
rounds, medians, the latency of an eager `hvd.allreduce` (float32, Sum) of
1 KB to 1 MB with the check on every call (the default), with
`TFSCALE_HOROVOD_CHECK=first` (each name checked on its first 3 calls),
and a bare mpi4py `Allreduce` of a NumPy buffer (the floor). Rank 0 prints
the table. Results go in benchmarks/README.md ("tfscale.horovod's argument
check").
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

from benchmarks import harness
import tfscale.horovod as hvd
from tfscale.horovod import _state

SIZES = (1 << 10, 16 << 10, 256 << 10, 1 << 20)


def timed(fn, calls: int) -> float:
    """Seconds per call of `fn` (ranks start together)."""
    comm = _state.get().comm
    fn()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    comm.Barrier()
    return (time.perf_counter() - start) / calls


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    parser.add_argument("--calls", type=int, default=300,
                        help="agreements timed a run")
    args = parser.parse_args(argv)
    hvd.init()
    state = _state.get()
    if state.size < 2:
        raise SystemExit("run it on 2 or more ranks: tfscale-run -np 2 "
                         "-H localhost:2 python -m benchmarks.scaling.hvd_agreement")
    from mpi4py import MPI
    rows = {(size, mode): [] for size in SIZES
            for mode in ("every", "first", "bare")}
    for _ in range(args.repeats):
        for size in SIZES:
            tensor = tf.ones([size // 4], tf.float32)
            array = np.ones(size // 4, np.float32)
            out = np.empty_like(array)
            for mode in ("every", "first"):
                state.check = mode
                state.checked.clear()
                rows[(size, mode)].append(timed(
                    lambda: hvd.allreduce(tensor, op=hvd.Sum,
                                          name=f"t{size}"), args.calls))
            rows[(size, "bare")].append(timed(
                lambda: state.comm.Allreduce(array, out, op=MPI.SUM),
                args.calls))
    state.check = "every"
    if state.rank:
        return
    print(f"{state.size} ranks, eager hvd.allreduce (float32, Sum), "
          f"medians of {args.repeats} rounds of {args.calls} calls")
    table = harness.Table(["size", "checked every call (ms)",
                           "first 3 calls of a name (ms)", "bare mpi4py (ms)",
                           "check's share of the call"], align="rrrrr")
    for size in SIZES:
        every, first, bare = (statistics.median(rows[(size, m)])
                              for m in ("every", "first", "bare"))
        table.row(f"{size // 1024} KB", f"{1000 * every:.3f}",
                  f"{1000 * first:.3f}", f"{1000 * bare:.3f}",
                  f"{(every - first) / every:.0%}")


if __name__ == "__main__":
    main()
