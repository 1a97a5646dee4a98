"""ZeRO stage 1: the optimizer's state sharded over the workers.

    optimizer.py   the sharded optimizer: each worker updates its slice
    layout.py      the flat layout of the weights, padded to N x S
    checkpoint.py  the checkpoint's view of the shards (any worker count)

It imports `tfscale.optim`, `tfscale.resume.checkpoints` (its errors) and
the base modules; the Trainer's parts build it.
"""
