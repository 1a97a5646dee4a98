r"""Measures your hosts' all-reduce for tfscale-plan: one process per host
(or per GPU), started as a job's workers are, each timing the gradient
all-reduce through tfscale's own collectives at a sweep of sizes.

    # two hosts, MPI (Open MPI from PyPI starts the remote rank over ssh):
    tfscale-run -np 2 -H node1:1,node2:1 python -m tfscale.cluster.link_probe \
        --backend mpi --output link.json
    # or the workers of a TF_CONFIG / SLURM job (gRPC, NCCL on GPUs):
    srun python -m tfscale.cluster.link_probe --output link.json
    tfscale-plan --link link.json --summary ...    # then

Each size is one float32 tensor all-reduced in a tf.function, as the
Trainer's step issues it; every repetition starts together (a barrier) and
the chief keeps the median. The chief writes --output: {"ranks",
"workers", "backend", "sizes" (bytes), "seconds"}, which tfscale-plan fits
to a latency and a bus bandwidth (`planning.collectives.fit_link`).
"""

import argparse
import json
import socket
import statistics
import sys
import time

DEFAULT_SIZES = "65536,262144,1048576,4194304,16777216"


def timed(fn, repeats: int, barrier) -> float:
    """Median seconds of `fn` over `repeats` calls, each started together
    (after one untimed call: tracing, buffers, connections)."""
    fn()
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def all_reduce_fn(collectives, strategy, nbytes: int, pieces: int = 1):
    """fn() -> one all-reduce of `pieces` float32 tensors totalling
    `nbytes`, as the Trainer's step issues it (replica context, inside a
    tf.function); the host waits for one value of the result."""
    import tensorflow as tf
    count = max(1, nbytes // 4)
    sizes = [count // pieces] * (pieces - 1)
    sizes.append(count - sum(sizes))
    with strategy.scope():
        tensors = [tf.ones([n], tf.float32) for n in sizes]

    def replica_fn(values):
        # (tf.identity places the values on the replica's device.)
        return collectives.all_reduce([tf.identity(v) for v in values])

    @tf.function
    def reduce(values):
        return strategy.run(lambda v: replica_fn(v)[-1][:1], args=(values,))

    def run():
        strategy.experimental_local_results(reduce(tensors))[0].numpy()
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="link_probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="the sweep's JSON file "
                   "(written by the chief)")
    p.add_argument("--backend", choices=["mwms", "mpi"], default="mwms")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="bytes, comma-separated (default: 64 KB to 16 MB)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    from tfscale.cluster import collectives as collectives_lib
    from tfscale.cluster import environment, strategies
    info = environment.resolve_cluster(backend=args.backend)
    strategy = strategies.make_strategy(info, environment.ClusterConfig(
        backend=args.backend, collective_timeout_seconds=600))
    collectives = collectives_lib.make(args.backend, strategy)
    seconds = [timed(all_reduce_fn(collectives, strategy, size),
                     args.repeats, collectives.barrier) for size in sizes]
    if info.is_chief:
        sweep = {"ranks": collectives.num_replicas,
                 "workers": info.num_workers, "cluster": info.source,
                 "chief": socket.gethostname(), "backend": args.backend,
                 "sizes": sizes, "seconds": seconds,
                 "repeats": args.repeats}
        with open(args.output, "w") as f:
            json.dump(sweep, f, indent=1)
        print(json.dumps(sweep))
    collectives.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
