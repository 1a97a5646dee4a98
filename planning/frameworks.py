"""What the training software adds to a step beyond compute and bytes: the
optimizer update's passes over the weights, a cost per gradient tensor per
step (a framework that negotiates each tensor before it reduces it), and
how much of the sync it hides behind the backward pass.

The figures are stated, each with where it comes from; they are not fitted
per run. The presets (`PRESETS`):

- tfscale: the update compiled into one program (about 10 float32 passes
  over the weights: read the weight, the gradient and two moments, write
  three, plus the norms), the gradients sent as packed all-reduces (no
  per-tensor cost), the sync after the step's compute (no overlap);
- horovod-nvidia-tf2: NVIDIA's TF2 BERT (DeepLearningExamples) on Horovod
  with its response cache: TF2's op-by-op LAMB with its float16 casts,
  clipping and the accumulators' reset, 85 passes; 0.03 ms a tensor; the
  sync after the accumulated micro-batches. Both figures were chosen once,
  together, so that the DGX A100 and DGX-2H tables of published.json are
  each within 10% from their 1-node row (planning/published.py);
- horovod-2017: Horovod 0.9, Sergeev and Del Balso's benchmark (every
  tensor negotiated with rank 0 every step: 0.25 ms a tensor), the fused
  all-reduces running beside the whole backward pass, SGD's update folded
  into the compute; chosen once so that its 16- and 512-GPU figures are
  each within 10% on the pcie-25gbe preset.

A framework file is JSON with `Framework`'s fields (`--framework my.json`).
"""

import dataclasses
from typing import Dict, Optional

from planning import preset_files


@dataclasses.dataclass(frozen=True)
class Framework:
    """The software side of a step.

    Attributes:
        name: What the tables print.
        update_passes: float32 passes over the weights the optimizer's
            update makes, at half the GPU's memory bandwidth (None: the
            update is folded into the measured compute).
        tensor_seconds: Seconds per gradient tensor per step spent before
            the tensors are reduced (negotiation, a launch each); 0 for
            packed all-reduces. Paid with more than one GPU.
        overlap: Share of the last backward pass the sync hides behind
            (0: the sync starts after the step's compute).
        measured_on_gpus: Whether published or measured multi-node GPU
            runs stand behind these figures. False (tfscale's own
            multi-worker GPU step, which has not run on several GPUs
            yet): the throughput band reaches `REFERENCE`'s, a framework
            that has.
    """

    name: str
    update_passes: Optional[float] = 10.0
    tensor_seconds: float = 0.0
    overlap: float = 0.0
    measured_on_gpus: bool = True

    def __post_init__(self):
        if self.update_passes is not None and self.update_passes < 0:
            raise ValueError(f"framework {self.name!r}: update_passes must "
                             f"be >= 0, got {self.update_passes}")
        if not 0 <= self.tensor_seconds < 0.1:
            raise ValueError(
                f"framework {self.name!r}: tensor_seconds is seconds per "
                f"tensor, in [0, 0.1): got {self.tensor_seconds}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"framework {self.name!r}: overlap must be in "
                             f"[0, 1], got {self.overlap}")


PRESETS: Dict[str, Framework] = {
    "tfscale": Framework("tfscale", update_passes=10.0,
                         measured_on_gpus=False),
    "horovod-nvidia-tf2": Framework("horovod-nvidia-tf2", update_passes=85.0,
                                    tensor_seconds=0.03e-3),
    "horovod-2017": Framework("horovod-2017", update_passes=None,
                              tensor_seconds=0.25e-3, overlap=1.0),
}

# What an unmeasured framework's band reaches: NVIDIA's TF2 BERT on Horovod,
# whose figures hold the published DGX tables (planning/published.py).
REFERENCE = "horovod-nvidia-tf2"


def load(name_or_path: str) -> Framework:
    """A preset by name, or a JSON file of `Framework`'s fields."""
    return preset_files.load("--framework", name_or_path, PRESETS,
                             Framework, kind="framework")
