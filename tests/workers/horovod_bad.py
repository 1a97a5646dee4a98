"""One rank of tests/test_horovod_ranks.py's bad-input runs.

    python tests/workers/horovod_bad.py MODE

mismatch        rank r passes a [r + 2, 3] tensor to one allreduce (eager),
                then the same inside a tf.function, then rank 1 passes
                float64 where rank 0 passes float32: each error is caught
                and printed (every rank raises it, so the job goes on)
late            rank 1 reaches hvd.init() 20 s after rank 0
crash           rank 1 raises while rank 0 waits in an allreduce
xla             an allreduce inside jit_compile=True
"""

import sys
import time

import tensorflow as tf

import tfscale.horovod as hvd


def main(mode):
    if mode == "late" and int(__import__("os").environ.get(
            "OMPI_COMM_WORLD_RANK", "0")) == 1:
        time.sleep(20)
    hvd.init()
    r = hvd.rank()
    if mode == "mismatch":
        calls = {
            "eager": lambda: hvd.allreduce(tf.ones([r + 2, 3]), name="grads"),
            "graph": tf.function(lambda: hvd.allreduce(tf.ones([r + 2, 3]),
                                                       name="grads")),
            "dtype": lambda: hvd.allreduce(
                tf.ones([3], tf.float32 if r == 0 else tf.float64),
                name="loss"),
            # Rank 1 issues one same-shaped collective more.
            "extra": lambda: [hvd.allreduce(tf.ones([2]), name=n)
                              for n in (["extra"] if r == 1 else [])
                              + ["grads"]]}
        for what, call in calls.items():
            try:
                call()
                print(f"rank {r}: {what}: no error", flush=True)
            except (ValueError, tf.errors.OpError) as e:
                line = next(l for l in str(e).splitlines()
                            if "tfscale.horovod: mismatched" in l)
                print(f"rank {r}: {what}: {line.split('tfscale.horovod:')[-1]}",
                      flush=True)
        # Still in step: a matching collective works afterwards.
        print(f"rank {r}: after: {hvd.allreduce(tf.ones([1]), op=hvd.Sum)}",
              flush=True)
        return
    elif mode == "crash":
        hvd.allreduce(tf.ones([1]))
        if r == 1:
            raise RuntimeError("out of memory (pretend)")
        hvd.allreduce(tf.ones([1]))
    elif mode == "xla":
        tf.function(lambda x: hvd.allreduce(x), jit_compile=True)(
            tf.ones([2]))
    print(f"rank {r}: no error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
