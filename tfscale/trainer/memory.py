"""What a worker's memory holds: its peak resident size, read from Linux;
its optimizer slots; what it sends per step (`worker_summary`, for
summary.json).

`peak_resident_bytes` is VmHWM of /proc/self/status: the most physical
memory the process has held at once (the number a cgroup or SLURM's
--mem limit is checked against), including TensorFlow's CPU allocator.
On a GPU the device's memory is another budget (`tf.config.experimental.
get_memory_info`).
"""

from typing import Optional

import numpy as np
import tensorflow as tf


def peak_resident_bytes(status: str = "/proc/self/status") -> Optional[int]:
    """This process's peak resident set (VmHWM), or None where the kernel
    does not report it (not Linux)."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024}.get(unit, 1)
    except OSError:
        return None
    return None


def optimizer_state_bytes(optimizer, sharded=None) -> int:
    """Bytes of optimizer slots a worker holds (moments, momentum; not the
    step count or the rate): the Keras optimizer's own (none when sharded:
    it is never built) and the sharded update's (`zero/optimizer.py`)."""
    own = {id(optimizer.iterations),
           id(getattr(optimizer, "_learning_rate", None))}
    held = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
               for v in optimizer.variables if id(v) not in own)
    if sharded is not None:
        held += sharded.state_bytes
    return held


def worker_summary(collectives, model, optimizer, sharded=None) -> dict:
    """What each worker holds and sends: the optimizer slots' bytes, every
    worker's peak resident memory (a collective: every worker calls it),
    and the bytes a worker sends per step for the gradients (and, sharded,
    the weights) against a ring all-reduce of the gradients."""
    peak = peak_resident_bytes() or 0
    peaks = [int(collectives.agree(
        float(peak) if i == collectives.worker_index else 0.0))
        for i in range(collectives.num_workers)]
    n = collectives.num_replicas
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    all_reduce = int(2 * (n - 1) / n * 4 * params)
    sent = (sharded.wire_bytes()["sharded"] if sharded is not None
            else all_reduce)
    return {"parameters": params,
            "shard_optimizer_state": sharded is not None,
            "optimizer_state_bytes_per_worker": optimizer_state_bytes(
                optimizer, sharded),
            "peak_resident_bytes": peaks,
            "gradient_bytes_sent_per_step": sent,
            "all_reduce_bytes_sent_per_step": all_reduce}
