"""Elastic runs: the ranks the hosts hold now, a failing host left out, a
new one taken in at the next step.

    tfscale-run --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \
        python run_pretraining.py --backend=mpi --micro_batch_size=8 ...

Horovod's elastic flags, with their meaning: the script prints the hosts
usable now, one a line, `host:slots` (or `host`, then `--slots-per-host`),
and is run again every `poll_seconds`. Each attempt is one `mpirun` over
the hosts found, less those that failed `host_failures` times in this run,
at most `max_np` ranks. Training state is never handed between live
processes (TensorFlow has no such thing): every change goes through the
job's checkpoint, and a resume on another worker count is exact at one
global batch (the global record order; `--micro_batch_size` keeps the
micro-batches), so an elastic run ends where an uninterrupted one at that
global batch ends.

  - A rank fails: its host is charged; the next attempt runs on what the
    discovery finds then, less the hosts that failed too often, from the
    last whole checkpoint (within `--max-restarts`).
  - While training, a host appears (fewer than `max_np` ranks run) or a
    host the ranks run on leaves the discovery output: every rank is asked
    to save (SIGUSR1 through mpirun: the agreed step's checkpoint, exit
    143) and the job restarts on the new set, not counted as a restart.
  - Fewer than `min_np` slots: the launcher waits `timeout_seconds` for
    hosts, polling, then ends, naming what is missing.

On one host (`launch.local --min_workers`, `local_slots`) the slots are
the workers' (each its port and its GPUs): a worker that keeps failing in
its slot (a GPU gone bad) is left out and the job goes on with the others.

Never imports TensorFlow.
"""

import dataclasses
import subprocess
import time
from collections import Counter
from typing import Callable, List, Optional, Sequence, Tuple

Hosts = List[Tuple[str, int]]


class DiscoveryError(ValueError):
    """The discovery script failed or printed something that is not a
    host list (one line naming the script)."""


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Horovod's elastic settings (tfscale-run's --min-np ... flags)."""

    min_np: int
    max_np: int
    discovery_script: str
    slots_per_host: int = 1
    poll_seconds: float = 5.0
    timeout_seconds: float = 600.0
    host_failures: int = 2
    script_seconds: float = 30.0
    min_flag: str = "--min-np"  # how the line names the minimum

    def __post_init__(self):
        if not 1 <= self.min_np <= self.max_np:
            raise ValueError(f"--min-np {self.min_np} and --max-np "
                             f"{self.max_np}: need 1 <= min <= max")
        if self.slots_per_host < 1 or self.host_failures < 1:
            raise ValueError("--slots-per-host and --host-failures must be "
                             ">= 1")
        if not 0.01 <= self.poll_seconds <= 3600:
            raise ValueError("--discovery-interval must be between 0.01 and "
                             f"3600 seconds, got {self.poll_seconds:g}")
        if not 0 <= self.timeout_seconds <= 7 * 86400:
            raise ValueError("--elastic-timeout must be between 0 and 7 days "
                             f"in seconds, got {self.timeout_seconds:g}")


def parse_hosts(text: str, slots_per_host: int, script: str) -> Hosts:
    """The script's output as [(host, slots)], in its order, a host once."""
    hosts = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, slots = line.rpartition(":")
        if not colon:
            name, slots = line, str(slots_per_host)
        if not name or not slots.isdigit() or int(slots) < 1 or " " in name:
            raise DiscoveryError(
                f"--host-discovery-script {script}: line {number} is "
                f"{line!r}, not 'host:slots' or 'host'")
        hosts[name] = int(slots)
    return list(hosts.items())


def discover(config: ElasticConfig) -> Hosts:
    """Runs the discovery script once: the hosts it prints."""
    try:
        done = subprocess.run(
            [config.discovery_script], capture_output=True, text=True,
            timeout=config.script_seconds, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DiscoveryError(f"--host-discovery-script "
                             f"{config.discovery_script}: {e}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise DiscoveryError(
            f"--host-discovery-script {config.discovery_script} exited "
            f"{done.returncode}" + (f": {said[-1]}" if said else ""))
    return parse_hosts(done.stdout, config.slots_per_host,
                       config.discovery_script)


@dataclasses.dataclass
class Elastic:
    """What `launch.local.run` needs for an elastic run: the membership
    and `mpirun_args(hosts)`, the mpirun options for an attempt's hosts."""

    membership: "Membership"
    # The mpirun options for an attempt's hosts (None: launch.local's own
    # worker slots, `local_slots`).
    mpirun_args: Optional[Callable[[Hosts], List[str]]]


def local_slots(num_workers: int, min_workers: int,
                host_failures: int = 2) -> Elastic:
    """`launch.local --min_workers`: the host's `num_workers` worker
    slots ("slot0", ... each with its port and GPUs), a slot whose worker
    failed `host_failures` times left out, never fewer than `min_workers`
    (no waiting: one host has no other slots to offer)."""
    slots = [(f"slot{i}", 1) for i in range(num_workers)]
    config = ElasticConfig(min_workers, num_workers,
                           discovery_script="launch.local's worker slots",
                           timeout_seconds=0.0, host_failures=host_failures,
                           min_flag="--min_workers")
    return Elastic(Membership(config, find=lambda: list(slots)),
                   mpirun_args=None)


def slot_indexes(hosts: Hosts) -> List[int]:
    """The worker slots of `local_slots` hosts: "slot3" -> 3."""
    return [int(host[len("slot"):]) for host, _ in hosts]


def words(hosts: Sequence[Tuple[str, int]]) -> str:
    return ",".join(f"{h}:{s}" for h, s in hosts) or "no host"


class Membership:
    """Which hosts the next attempt runs on, and why it changes.

    Args:
        config: The elastic settings.
        find: `fn() -> Hosts` (default: `discover(config)`).
        clock: `time.monotonic` (tests pass their own).
    """

    def __init__(self, config: ElasticConfig,
                 find: Optional[Callable[[], Hosts]] = None,
                 clock=time.monotonic):
        self.config = config
        self._find = find or (lambda: discover(config))
        self._clock = clock
        self._failures = Counter()
        self.hosts: Hosts = []  # the current attempt's
        self._last_poll = None

    @property
    def num_workers(self) -> int:
        return sum(slots for _, slots in self.hosts)

    def usable(self, found: Hosts) -> Hosts:
        """`found` less the hosts that failed too often, cut to max_np
        slots (the first hosts first)."""
        left, chosen = self.config.max_np, []
        for host, slots in found:
            if self._failures[host] >= self.config.host_failures or not left:
                continue
            chosen.append((host, min(slots, left)))
            left -= chosen[-1][1]
        return chosen

    def changes(self, before: Hosts) -> str:
        """How `hosts` differ from `before`, in words ("" when they do
        not, or there was no before)."""
        if not before:
            return ""
        now, then = dict(self.hosts), dict(before)
        left_out = set(self.excluded())
        said = [f"{h} left out after failing" if h in left_out else
                f"{h} gone from the discovery output"
                for h in then if h not in now]
        said += [f"{h} joined" for h in now if h not in then]
        return "; ".join(said)

    def excluded(self) -> List[str]:
        return sorted(h for h, n in self._failures.items()
                      if n >= self.config.host_failures)

    def next_hosts(self, interrupted=()) -> Optional[Hosts]:
        """The hosts of the next attempt (kept in `hosts`): polls until
        they hold `min_np` slots, or None after `timeout_seconds` (or a
        signal)."""
        deadline = self._clock() + self.config.timeout_seconds
        while True:
            hosts = self.usable(self._find())
            if sum(s for _, s in hosts) >= self.config.min_np:
                self.hosts = hosts
                self._last_poll = self._clock()
                return hosts
            if self._clock() >= deadline or interrupted:
                self.hosts = hosts
                return None
            time.sleep(min(self.config.poll_seconds,
                           max(deadline - self._clock(), 0.01)))

    def change(self) -> Optional[str]:
        """While an attempt runs (polled at most every `poll_seconds`): why
        the job should move to another host set now, or None. A failing
        script is not a change (the hosts already running go on)."""
        now = self._clock()
        if self._last_poll is not None and (
                now - self._last_poll < self.config.poll_seconds):
            return None
        self._last_poll = now
        try:
            found = dict(self._find())
        except DiscoveryError:
            return None
        gone = [h for h, _ in self.hosts if h not in found]
        if gone:
            return (f"{', '.join(gone)} left the discovery output")
        new = self.usable(list(found.items()))
        if sum(s for _, s in new) > self.num_workers:
            added = [h for h, _ in new if h not in dict(self.hosts)]
            return (f"{', '.join(added) or 'more slots'} joined the discovery "
                    "output")
        return None

    def failed(self, rank: Optional[int], lost_peer=None) -> str:
        """Charges the host of the failure: `rank`'s (mpirun's --map-by
        slot order), or when `rank` only lost a peer (`lost_peer`: rank ->
        the peer's host, None when MPI did not say; `mpi_ranks.MpiGroup`)
        that peer's host. What that means, in words ("" when no host is
        known)."""
        lost_peer = lost_peer or {}
        host = (lost_peer[rank] if rank in lost_peer else
                rank_host(self.hosts, rank))
        if host is None:
            return ""
        self._failures[host] += 1
        count = self._failures[host]
        if count >= self.config.host_failures:
            return (f"{host} has failed {count} time(s): left out from now "
                    "on")
        return f"{host} has failed {count} time(s)"

    def too_few(self) -> str:
        """Why no attempt can start: the slots found and those left out."""
        left_out = self.excluded()
        return (f"fewer than {self.config.min_flag} {self.config.min_np} "
                f"slots for "
                f"{self.config.timeout_seconds:g} s (found: "
                f"{words(self.hosts)}" +
                (f"; left out after failing: {', '.join(left_out)}"
                 if left_out else "") + ")")


def rank_host(hosts: Hosts, rank: Optional[int]) -> Optional[str]:
    """The host of `rank` when mpirun maps ranks by slot over `hosts`."""
    if rank is None:
        return None
    for host, slots in hosts:
        if rank < slots:
            return host
        rank -= slots
    return None
