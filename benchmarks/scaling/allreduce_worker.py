"""One rank of benchmarks/scaling/allreduce.py (started by mpirun or launch.local).

For each size: the time of one all-reduce through the backend's path in
tfscale, in a tf.function as the Trainer's step issues it, of one float32
tensor of that size (the TensorFlow boundary alone) and of 8 tensors summing
to it (plus the fusion buffer: concat and split), and for MPI also a bare mpi4py `Allreduce`
of a NumPy buffer of the same size and `tfscale.horovod.allreduce` (eager
and in a tf.function), and the link: a bidirectional exchange
of the same size between ranks 0 and 1 (`Sendrecv`, what one ring step
does). Rank 0 writes JSON lines to --result_file.
"""

import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from tfscale.cluster import environment as cluster_lib  # noqa: E402
from tfscale.cluster import strategies  # noqa: E402
from tfscale.cluster import collectives as collectives_lib  # noqa: E402
from tfscale.cluster.link_probe import all_reduce_fn, timed  # noqa: E402

PIECES = 8  # tensors in the fused variant


def repetitions(nbytes: int, budget_bytes: float) -> int:
    return int(max(3, min(50, budget_bytes // max(nbytes, 1))))


def tfscale_allreduce(collectives, strategy, nbytes: int, pieces: int):
    """fn() -> one all-reduce of `pieces` tensors totalling nbytes, as the
    Trainer's step issues it (`tfscale.cluster.link_probe`)."""
    return all_reduce_fn(collectives, strategy, nbytes, pieces)


def horovod_allreduce(nbytes: int, reps: int, barrier) -> dict:
    """`hvd.allreduce` (tfscale.horovod) of one float32 tensor: called
    eagerly, as Horovod scripts and benchmarks do, and inside a
    tf.function."""
    import tfscale.horovod as hvd
    hvd.init()
    tensor = tf.ones([nbytes // 4], tf.float32)
    in_graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum)[:1])
    return {"hvd_eager_seconds": timed(
                lambda: hvd.allreduce(tensor, op=hvd.Sum), reps, barrier),
            "hvd_graph_seconds": timed(
                lambda: in_graph(tensor).numpy(), reps, barrier)}


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["mwms", "mpi"], required=True,
                   help="how workers sum gradients: mwms "
                        "(MultiWorkerMirroredStrategy) or mpi (MPI.Allreduce)")
    p.add_argument("--sizes", required=True, help="bytes, comma-separated")
    p.add_argument("--budget_bytes", type=float, default=2e9,
                   help="bytes moved per size and method (sets repetitions)")
    p.add_argument("--result_file", required=True,
                   help="where this worker writes its timings as JSON (the "
                        "benchmark that starts it sets it)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    info = cluster_lib.resolve_cluster(backend=args.backend)
    config = cluster_lib.ClusterConfig(backend=args.backend,
                                       collective_timeout_seconds=600)
    strategy = strategies.make_strategy(info, config)
    collectives = collectives_lib.make(args.backend, strategy)
    comm = getattr(collectives, "comm", None)
    barrier = collectives.barrier
    rows = []
    for nbytes in sizes:
        reps = repetitions(nbytes, args.budget_bytes)
        row = {"backend": args.backend, "num_workers": info.num_workers,
               "bytes": nbytes, "repetitions": reps,
               "tfscale_seconds": timed(
                   tfscale_allreduce(collectives, strategy, nbytes, 1), reps,
                   barrier),
               "fused_seconds": timed(
                   tfscale_allreduce(collectives, strategy, nbytes, PIECES),
                   reps, barrier)}
        if comm is not None:
            from mpi4py import MPI
            send = np.ones(nbytes // 4, np.float32)
            receive = np.empty_like(send)
            row["bare_seconds"] = timed(
                lambda: comm.Allreduce(send, receive, op=MPI.SUM), reps,
                barrier)
            row.update(horovod_allreduce(nbytes, reps, barrier))
            peer = {0: 1, 1: 0}.get(comm.rank)

            def exchange():
                if peer is not None:
                    comm.Sendrecv(send, dest=peer, recvbuf=receive,
                                  source=peer)
            row["link_seconds"] = timed(exchange, reps, barrier)
        rows.append(row)
        if info.is_chief:
            print(json.dumps(row), flush=True)
    if info.is_chief:
        with open(args.result_file, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
