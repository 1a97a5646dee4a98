"""The gradient noise scale, measured in every training step.

    numbers.py   one step's numbers, as the step's row holds them
    norms.py     the variable groups and the squared norms the step computes
    scale.py     the estimator: moving averages, B_simple and its interval
    advice.py    what a run's noise scale says about its batch, in words

Below the step: it imports `tfscale.optim` (LAMB's exclusions), `errors`
and `_compat`; the step (`tfscale.step`) imports it.
"""
