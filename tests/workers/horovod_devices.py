"""One rank of tests/test_horovod_ranks.py's placement checks.

    tfscale-run -np 2 -H localhost:2 python tests/workers/horovod_devices.py DEVICE OUT

Runs tfscale.horovod's collectives on inputs placed on DEVICE ("/cpu:1", one
of two logical CPUs this script makes, or "/gpu:0"), eagerly and inside a
`tf.function`, and writes OUT/rank-R.json: each result's values and the
device it came back on, and variables on DEVICE after broadcast_variables
(rank 1 starts from other values). MPI only touches host memory: on a GPU
an output made on the device and filled through a host copy would come
back uninitialised, which the values show.
"""

import json
import os
import sys

import tensorflow as tf

DEVICE, OUT = sys.argv[1], sys.argv[2]
if DEVICE.startswith("/cpu"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)

import tfscale.horovod as hvd  # noqa: E402


def placed(result):
    return {"values": result.numpy().tolist(), "device": result.device}


def main():
    hvd.init()
    r = hvd.rank()
    with tf.device(DEVICE):
        x = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
        pair = [x, tf.constant([[r + 1.0]])]
        variables = [tf.Variable(tf.fill([2, 3], float(r + 5))),
                     tf.Variable([r + 1.0])]
    got = {"eager": {
        "allreduce": placed(hvd.allreduce(x, op=hvd.Sum)),
        "grouped": [placed(t) for t in hvd.grouped_allreduce(pair,
                                                             op=hvd.Sum)],
        "allgather": placed(hvd.allgather(x)),
        "broadcast": placed(hvd.broadcast(x, root_rank=1)),
    }}

    @tf.function
    def compiled(a):
        with tf.device(DEVICE):
            return {"allreduce": hvd.allreduce(a, op=hvd.Sum),
                    "allgather": hvd.allgather(a),
                    "broadcast": hvd.broadcast(a, root_rank=1)}
    got["graph"] = {k: placed(v) for k, v in compiled(x).items()}
    hvd.broadcast_variables(variables, root_rank=0)
    got["variables"] = [placed(tf.convert_to_tensor(v)) for v in variables]
    got["variable_devices"] = [v.device for v in variables]
    with open(os.path.join(OUT, f"rank-{r}.json"), "w") as f:
        json.dump(got, f)
    print(f"rank {r}: done", flush=True)


if __name__ == "__main__":
    main()
