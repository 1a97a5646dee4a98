"""A worker that hangs, named: from the heartbeats the workers write.

Each worker rewrites `worker-<i>` in the launcher's heartbeat folder with
the phase it is in and its step (`tfscale/cluster/heartbeat.py`).
`HangWatch.check` reads them as the launcher polls and times each phase.
The worker furthest behind (its peers, further on, wait for it inside a
collective, silent too) is hung when it has been silent for longer than its
phase's timeout: `factor` times the longest this run has shown for that
phase (any worker's), held between a floor and a ceiling (flags); a phase
never seen before (the first compile, checkpoint, evaluation) gets the
ceiling. A slow worker that still beats is not hung. Before a worker's first heartbeat
(imports, the cluster's start, which `--connect_timeout` bounds) nothing is
checked, nor for a worker that writes none (a script of its own).

Also: a worker the kernel holds stopped (SIGSTOP, a debugger), whose peers
see its heartbeats stop and fail naming it, is named as the cause
(`stopped`). Never imports TensorFlow.
"""

import dataclasses
import os
import time
from typing import Dict, List, Optional, Tuple

from tfscale.cluster.contract import heartbeat_path


@dataclasses.dataclass(frozen=True)
class HangLimits:
    """How long a phase may stay silent: `factor` x the longest seen,
    within [floor_seconds, ceiling_seconds]."""

    floor_seconds: float = 180.0
    ceiling_seconds: float = 1800.0
    factor: float = 10.0

    def timeout(self, longest: Optional[float]) -> float:
        if not longest:
            return self.ceiling_seconds
        return min(max(self.factor * longest, self.floor_seconds),
                   self.ceiling_seconds)


@dataclasses.dataclass
class _Seen:
    """What one worker's heartbeat said last, and when it changed."""

    phase: str
    step: int
    changed: float

    @property
    def progress(self) -> int:
        """How far the worker got: after step S, 2S between calls, 2S + 1
        inside the next call (or a checkpoint, an evaluation: collective
        work); the restore and the compile before any step."""
        inside = self.phase in ("call", "checkpoint", "evaluation",
                                "compile")
        return 2 * self.step + (1 if inside else 0)


class HangWatch:
    """The heartbeats of `num_workers` workers in `folder`.

    Args:
        folder: The launcher's heartbeat folder.
        num_workers: How many workers write there.
        limits: The timeouts.
        clock: `time.monotonic` (tests pass their own).
    """

    def __init__(self, folder: str, num_workers: int, limits: HangLimits,
                 clock=time.monotonic):
        self._paths = [heartbeat_path(folder, i) for i in range(num_workers)]
        self._limits = limits
        self._clock = clock
        self._seen: Dict[int, _Seen] = {}
        self._longest: Dict[str, float] = {}

    def reset(self) -> None:
        """A new attempt: the heartbeats of the last are gone; what this
        run showed of its phases' times stays."""
        for path in self._paths:
            try:
                os.remove(path)
            except OSError:
                pass
        self._seen = {}

    def check(self) -> Optional[Tuple[int, str]]:
        """(worker, why) when the worker furthest behind has been silent
        past its phase's timeout (its peers wait for it in a collective,
        silent too, but further on), or None. A slow worker that still
        beats is not hung."""
        now = self._clock()
        for index, path in enumerate(self._paths):
            parsed = _parse(_read(path))
            if parsed is None:
                continue
            seen = self._seen.get(index)
            if seen is None or (seen.phase, seen.step) != parsed:
                if seen is not None:  # the phase it left took this long
                    took = now - seen.changed
                    self._longest[seen.phase] = max(
                        took, self._longest.get(seen.phase, 0.0))
                self._seen[index] = _Seen(*parsed, now)
        if not self._seen:
            return None
        index, seen = min(self._seen.items(),
                          key=lambda item: (item[1].progress,
                                            item[1].changed))
        silent = now - seen.changed
        longest = self._longest_of(seen.phase)
        if silent <= self._limits.timeout(longest):
            return None
        behind = [i for i, s in self._seen.items()
                  if s.progress == seen.progress]
        return index, _why(index, seen, silent, longest,
                           alone=len(behind) == 1 or len(self._seen) == 1,
                           limits=self._limits)


    def _longest_of(self, phase: str) -> Optional[float]:
        """The longest this run has shown of `phase`; the steady phases
        (in a call, between calls) share theirs, and once the first call
        is done a step phase never timed counts as short (the floor)."""
        if phase not in _STEADY:
            return self._longest.get(phase)
        return max((self._longest.get(p, 0.0) for p in _STEADY),
                   default=0.0) or _SHORT_SECONDS


# The phases every step goes through (`_longest_of`); a time that stands
# for "shorter than the launcher could see" (its poll).
_STEADY = ("call", "step")
_SHORT_SECONDS = 0.1


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _parse(text: str) -> Optional[Tuple[str, int]]:
    """(phase, step) of a heartbeat line; None for none (or one being
    rewritten)."""
    parts = text.split()
    try:
        return parts[0], int(parts[1])
    except (IndexError, ValueError):
        return None


_WHAT = {"call": "end of its step call", "step": "next step call",
         "compile": "end of its first call (compiling)",
         "restore": "end of its restore", "checkpoint": "end of its "
         "checkpoint", "evaluation": "end of its evaluation",
         "epoch_end": "end of its epoch's callbacks"}


def _why(index: int, seen: _Seen, silent: float, longest: Optional[float],
         alone: bool, limits: HangLimits) -> str:
    """"no next step call for 94 s, 10x the slowest of this phase (9.4 s);
    last seen between step calls after step 4,312" (of worker `index`)."""
    if not longest:
        pace = ", past the ceiling (no earlier time bounds this phase)"
    elif limits.timeout(longest) <= limits.floor_seconds:
        pace = (f", past the floor of {limits.floor_seconds:g} s (this "
                f"phase took at most {longest:.1f} s before)")
    else:
        pace = (f", {silent / longest:.0f}x the slowest of this phase "
                f"({longest:.1f} s)")
    place = {"step": "between step calls", "call": "inside a step call",
             "epoch_end": "in the epoch's end callbacks"}.get(
                 seen.phase, f"in its {seen.phase}")
    where = (f"last seen {place} after step {seen.step:,}" if alone else
             f"every worker waits {place} after step {seen.step:,} (a "
             "collective whose peer or link stopped)")
    del index
    return f"no {_WHAT.get(seen.phase, seen.phase)} for {silent:.0f} s" \
        f"{pace}; {where}"


def stopped(pid: int) -> bool:
    """Whether the kernel holds process `pid` stopped (SIGSTOP, SIGTSTP,
    a debugger): state T or t in /proc (Linux; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (name) S ...": the state follows the last ')'.
    return stat.rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])


def stopped_workers(pids: List[Optional[int]]) -> List[int]:
    """Indexes of the workers (live pids) the kernel holds stopped."""
    return [i for i, pid in enumerate(pids) if pid and stopped(pid)]
