"""Where this process sits and how the workers talk: the cluster layer.

    environment.py   TF_CONFIG, SLURM and MPI's variables -> ClusterConfig,
                     ClusterInfo (the only reader of the cluster environment)
    strategies.py    the tf.distribute strategy for a resolved cluster
    all_reduce_impl.py
                     NCCL or the gRPC ring for MWMS's all-reduce (TensorFlow's
                     AUTO is the ring); workers on NCCL compare their GPUs;
                     NCCL's library loaded as TensorFlow loads it
    gpu_binding.py   each process keeps its own GPUs (by its local rank)
                     before TensorFlow's runtime starts
    devices.py       the GPUs this process sees; the devices a strategy's
                     replicas sit on (TensorFlow's default strategy too)
    placement.py     replicas and variables checked against those GPUs
                     before the first step; the banner's placement line
    collectives.py   how workers sum and agree: one object per backend
    mpi.py           the MPI backend (mpi4py's Allreduce)
    fail_fast.py     one failed worker ends the job at once
    signal_watch.py  SIGTERM, SIGUSR1 and Ctrl-C recorded for a run to act
                     on where its workers agree
    heartbeat.py     the phase a worker is in, for its launcher's hang watch
    watchdog.py      the start-up watchdog process
    link_probe.py    your hosts' all-reduce at a sweep of sizes, for
                     tfscale-plan --link
    contract.py      names the launchers and workers agree on (imports nothing)

It imports only `tfscale.errors` and `tfscale._compat` from the engine.
Importing the package loads no TensorFlow: `ClusterConfig`, `ClusterInfo`,
`ClusterError` and `resolve_cluster` load `environment.py` on first use.
"""

from tfscale.lazy import exports

__getattr__ = exports(__name__, {
    "ClusterConfig": "tfscale.cluster.environment",
    "ClusterInfo": "tfscale.cluster.environment",
    "ClusterError": "tfscale.cluster.environment",
    "resolve_cluster": "tfscale.cluster.environment",
})
