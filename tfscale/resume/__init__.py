"""A run that survives: checkpoints, where a run is, preemption, the start.

    checkpoints.py  what a checkpoint holds; save and restore
    position.py     the run's step and its input's global record position
    start.py        where a `fit` starts (fresh or resumed) and its input
    preemption.py   SIGTERM -> an agreed step -> a checkpoint -> exit 143
    compare.py      two runs' final weights and slots compared (python -m
                    tfscale.resume.compare A B)

It imports `tfscale.step.feed` (the input it positions), the Keras
callbacks' workarounds (`tfscale.keras.callbacks`) and the base modules.
"""
