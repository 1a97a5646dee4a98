"""Which global positions an input pipeline reads, and where a run resumes.

Positions count records from the start of the run, across epochs: position
q is record `permute(q mod n)` of epoch `q // n`. A *global micro-batch* is
M = per-replica batch x all replicas consecutive positions; pipeline p of N
(one per worker) takes its m = M / N positions [p*m, (p+1)*m) of each one,
and hands them to its local replicas in order. An optimizer step of global
batch B = M x accumulation steps therefore holds positions [s*B, (s+1)*B),
whatever N, the replicas per worker or the accumulation steps: the same
records, only split differently. A resumed run starts at the position its
checkpoint holds (O(1): nothing is re-read), on any worker count whose
micro-batch divides it.
"""

import dataclasses

import numpy as np

from input_pipelines.record_order import shuffle


@dataclasses.dataclass(frozen=True)
class Slice:
    """One input pipeline's share of the global order.

    Attributes:
        num_pipelines: Input pipelines (workers).
        pipeline_id: This one's index.
        per_pipeline_batch: m, its records per global micro-batch (the
            per-replica batch x its local replicas).
        start_position: First global position of the run's remaining part;
            a multiple of the global micro-batch.
    """

    num_pipelines: int
    pipeline_id: int
    per_pipeline_batch: int
    start_position: int = 0

    def __post_init__(self):
        if not 0 <= self.pipeline_id < self.num_pipelines:
            raise ValueError(f"pipeline_id {self.pipeline_id} is not in "
                             f"[0, {self.num_pipelines})")
        if self.per_pipeline_batch < 1:
            raise ValueError("per_pipeline_batch must be >= 1")
        if self.start_position % self.global_micro_batch:
            raise ValueError(
                f"input position {self.start_position} is not a multiple of "
                f"the global micro-batch {self.global_micro_batch} (per-"
                f"replica batch x replicas): resume with a global batch and "
                "worker count that divide it")

    @property
    def global_micro_batch(self) -> int:
        return self.per_pipeline_batch * self.num_pipelines

    def positions(self, first_micro_batch: int, num_micro_batches: int
                  ) -> np.ndarray:
        """This pipeline's positions in `num_micro_batches` consecutive
        global micro-batches after the start, in the order it reads them."""
        steps = (self.start_position // self.global_micro_batch
                 + first_micro_batch + np.arange(num_micro_batches,
                                                 dtype=np.int64))
        own = steps[:, None] * self.global_micro_batch + (
            self.pipeline_id * self.per_pipeline_batch
            + np.arange(self.per_pipeline_batch, dtype=np.int64))
        return own.reshape(-1)


def records_at(positions: np.ndarray, num_records: int, seed: int) -> np.ndarray:
    """Record numbers (in [0, num_records)) at global `positions`: each epoch
    is its own seeded permutation."""
    positions = np.asarray(positions, dtype=np.int64)
    epochs, within = np.divmod(positions, num_records)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        where = epochs == epoch
        out[where] = shuffle.permute(
            within[where], num_records, shuffle.epoch_key(seed, int(epoch)))
    return out
