"""The compiled training step: one call runs one or more optimizer steps.

    train_step.py    `TrainStep`: the call's layout around `strategy.run`,
                     the all-reduce, the update and XLA
    replica.py       what one replica computes (forward, backward, micro-
                     batches)
    sharded_sync.py  the sync with sharded optimizer state (ZeRO-1)
    feed.py          per-replica inputs from a worker's tf.data pipeline
    losses.py        the loss per example and the metrics summed over workers
    plan.py, row.py  which steps a call runs and the row each returns (plain
                     Python, no TensorFlow)
    pace.py          how many steps fit in a call's wall-time bound, agreed
                     by all workers (plain Python)

It imports `tfscale.train_config`, `tfscale.noise` and the cluster layer;
the Trainer (`tfscale.trainer`) drives it.
"""
