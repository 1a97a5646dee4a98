"""Every worker's log interval on the chief: a straggler named, a stall said.

In synchronous data-parallel training the slowest worker sets every step:
its peers wait for it inside the gradient all-reduce, where their own
"sync" time grows and its own does not. So each worker's own work (input
wait and compute, from the interval's timed steps: `timing.py`) is what
tells the straggler apart; the chief alone cannot see it.

At each interval's close every worker hands its numbers to the chief
(`collectives.gather`: the coordination service's key-value store on
MultiWorkerMirroredStrategy, no collective in the step; one `MPI_Gather`
on the MPI backend), which keeps them (summary.json's intervals, the
TensorBoard scalars `batch_worker<i>/<phase>`) and compares: a worker
whose own work, averaged over the last `STRAGGLER_WINDOW` intervals, is more
than `threshold` above the median of the others' is named with its host,
once, and again once it keeps pace.

`StallWatch` (every worker count) says when steps have run more than
`STALL_FACTOR` times slower than the run's median interval for a minute
(a throttled GPU, a file system gone slow, a peer in trouble).
"""

import json
import socket
import statistics
from typing import Dict, Optional

# The numbers of a worker's interval the chief gathers (`timing.PHASES`
# and the step's wall time over all its steps).
FIELDS = ("input_wait", "compute", "sync", "update", "step_time")
# Intervals a worker's own work is averaged over before it is compared.
STRAGGLER_WINDOW = 3
# How long the chief waits at an interval's end for a worker's numbers
# (every worker ends the interval at the same step).
GATHER_SECONDS = 60.0
STALL_FACTOR = 10.0
STALL_SECONDS = 60.0


def own_work(numbers: dict) -> float:
    """Seconds a step took this worker itself: its input wait and compute
    (its "sync" is the wait for the slowest peer, the update the same
    everywhere)."""
    return numbers["input_wait"] + numbers["compute"]


class PeerIntervals:
    """Gathers each interval's per-worker numbers and names stragglers.

    Args:
        collectives: The Trainer's (`collectives.py`).
        threshold: A worker whose own work is more than this fraction above
            the others' median is a straggler (0 or less: never named).
        host: This worker's host name.
    """

    def __init__(self, collectives, threshold: float = 0.2,
                 host: str = None):
        self._collectives = collectives
        self._threshold = threshold
        self._host = host or socket.gethostname()
        self._history: Dict[int, list] = {}  # worker -> own work per interval
        self._hosts: Dict[int, str] = {}
        self._named = set()  # workers said to be straggling

    def gather(self, summary: dict) -> Optional[Dict[str, dict]]:
        """This interval's numbers of every worker, {"0": {...}, ...}, on
        the chief (None elsewhere, and on one worker)."""
        if self._collectives.num_workers == 1:
            return None
        mine = {field: float(summary.get(field, 0.0)) for field in FIELDS}
        mine["timed_steps"] = int(summary.get("timed_steps", 0))
        mine["host"] = self._host
        values = self._collectives.gather("interval", json.dumps(mine),
                                          GATHER_SECONDS)
        if not self._collectives.is_chief:
            return None
        workers = {str(index): json.loads(text)
                   for index, text in sorted(values.items())}
        for index, numbers in workers.items():
            self._hosts[int(index)] = numbers.pop("host")
        return workers

    def stragglers(self, workers: Dict[str, dict], step: int,
                   first: bool) -> list:
        """The lines this interval calls for: a worker named as a
        straggler, or as keeping pace again. Intervals with no timed step,
        and a fit's first (compilation), are not compared."""
        if self._threshold <= 0 or first:
            return []
        if any(n["timed_steps"] == 0 for n in workers.values()):
            return []
        for index, numbers in workers.items():
            window = self._history.setdefault(int(index), [])
            window.append(own_work(numbers))
            del window[:-STRAGGLER_WINDOW]
        means = {i: statistics.fmean(w) for i, w in self._history.items()
                 if i in map(int, workers)}
        lines = []
        for index, mean in sorted(means.items()):
            others = statistics.median(
                m for i, m in means.items() if i != index)
            slow = others > 0 and mean > (1 + self._threshold) * others
            if slow and index not in self._named:
                self._named.add(index)
                lines.append(self._slow_line(index, workers, mean, others,
                                             step))
            elif not slow and index in self._named:
                self._named.discard(index)
                lines.append(f"worker {index} on {self._hosts[index]} keeps "
                             f"pace again at step {step}: input + compute "
                             f"{1000 * mean:.1f} ms a step, the others' "
                             f"median {1000 * others:.1f} ms")
        return lines

    def _slow_line(self, index: int, workers, mean: float, others: float,
                   step: int) -> str:
        numbers = workers[str(index)]
        waits = [n["sync"] for i, n in workers.items() if int(i) != index]
        count = len(self._history[index])
        return (f"straggler: worker {index} on {self._hosts[index]}: input + "
                f"compute {1000 * mean:.1f} ms a step (input "
                f"{1000 * numbers['input_wait']:.1f}, compute "
                f"{1000 * numbers['compute']:.1f}), {mean / others:.2f}x the "
                f"other workers' median {1000 * others:.1f} ms over the last "
                f"{count} interval(s) to step {step}; they wait for it "
                f"(their sync {1000 * statistics.median(waits):.1f} ms a "
                "step)")


class StallWatch:
    """Says when steps run `STALL_FACTOR` x slower than the run's median
    interval for `STALL_SECONDS` in a row (once, until they recover)."""

    def __init__(self, factor: float = STALL_FACTOR,
                 seconds: float = STALL_SECONDS):
        self._factor = factor
        self._seconds = seconds
        self._step_times = []  # steady intervals' step times
        self._slow_seconds = 0.0
        self._said = False

    def check(self, summary: dict, step: int) -> Optional[str]:
        """The line for this interval, or None. A fit's first interval
        (compilation) is neither compared nor kept."""
        if summary.get("first") or not summary.get("steps"):
            return None
        step_time = summary["step_time"]
        median = (statistics.median(self._step_times)
                  if self._step_times else None)
        if median is None or step_time <= self._factor * median:
            # (A slow interval is not kept: the median stays the run's.)
            self._step_times.append(step_time)
            self._slow_seconds, self._said = 0.0, False
            return None
        self._slow_seconds += summary["steps"] * step_time
        if self._said or self._slow_seconds < self._seconds:
            return None
        self._said = True
        return (f"steps have taken {1000 * step_time:.0f} ms for "
                f"{self._slow_seconds:.0f} s to step {step}, "
                f"{step_time / median:.0f}x this run's median "
                f"{1000 * median:.1f} ms: a throttled or shared device, a "
                "slow file system or a peer in trouble (the stragglers' "
                "lines and each worker's numbers in summary.json say which)")
