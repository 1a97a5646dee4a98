"""The Trainer: a `fit`-like loop for any Keras 3 model under any strategy.

    loop.py        `Trainer`: fit and evaluate, top to bottom
    parts.py       its parts, built in the one order that works
    evaluation.py  evaluation on all workers
    reporting.py   a log interval's numbers and line
    timing.py      the step's wall-clock split (input, compute, sync, update)
    peers.py       every worker's split on the chief: stragglers, stalls
    memory.py      the process's memory, for the summary
    console.py     the lines it says to a person

The top of the engine below the jobs: it imports every other package.
`Trainer` and `TrainConfig` load on first use (`from tfscale.trainer import
Trainer`).
"""

from tfscale.lazy import exports

__getattr__ = exports(__name__, {
    "Trainer": "tfscale.trainer.loop",
    "TrainConfig": "tfscale.train_config",
})
