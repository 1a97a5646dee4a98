"""Optimizers, learning-rate schedules and batch-size scaling rules.

    factory.py    OptimConfig -> an optimizer and its schedule (the flags'
                  names), the batch-size scaling rules
    lamb.py       LAMB with weight decay inside the trust ratio
    adascale.py   AdaScale: the learning rate scaled by the gradient's noise
    schedules.py  warmup + polynomial or cosine decay

The bottom of the engine but for the base modules: it imports only
`tfscale.errors` and `tfscale._compat`.
"""

from tfscale.optim.factory import OptimConfig, make_learning_rate, make_optimizer
from tfscale.optim.factory import scale_learning_rate
from tfscale.optim.lamb import Lamb
from tfscale.optim.schedules import WarmupCosineDecay, WarmupPolynomialDecay
