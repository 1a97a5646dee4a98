"""One step's numbers for the gradient noise scale, as the step's row
holds them (`tfscale/step/row.py` reads them out of it, `scale.py` adds
them up). Plain Python: the step's row needs no TensorFlow.
"""

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class NoiseNumbers:
    """One step's numbers for the gradient noise scale.

    Attributes:
        small_sums: Per group, the sum over the step's micro-batches of the
            squared norm of each one's contribution to the step's gradient.
        count: Micro-batches in the step (replicas x accumulation).
        big: Per group, the squared norm of the step's reduced gradient.
        ready: > 0 when the preconditioner counts this step (always, plain).
    """

    small_sums: Tuple[float, ...]
    count: float
    big: Tuple[float, ...]
    ready: float
