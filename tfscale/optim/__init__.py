"""Optimizers, learning-rate schedules and batch-size scaling rules."""

from tfscale.optim.factory import OptimConfig, make_learning_rate, make_optimizer
from tfscale.optim.factory import scale_learning_rate
from tfscale.optim.lamb import Lamb
from tfscale.optim.schedules import WarmupCosineDecay, WarmupPolynomialDecay
