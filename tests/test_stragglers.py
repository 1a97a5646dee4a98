"""Every worker's interval on the chief; a straggler named, a stall said
(tfscale/trainer/peers.py), in units and in a real 2-worker run."""

import json
import sys

import pytest

from tests.conftest import run_command
from tfscale.trainer import peers


class Gathering:
    """Collectives whose `gather` hands the chief the numbers the test set."""

    def __init__(self, is_chief=True, num_workers=3):
        self.is_chief, self.num_workers = is_chief, num_workers
        self.worker_index = 0 if is_chief else 1
        self.theirs = {}
        self.sent = []

    def gather(self, name, mine, seconds):
        self.sent.append((name, json.loads(mine)))
        if not self.is_chief:
            return {self.worker_index: mine}
        return {0: mine, **{i: json.dumps(n) for i, n in self.theirs.items()}}


def interval(compute, input_wait=0.001, sync=0.002, timed=4):
    return {"input_wait": input_wait, "compute": compute, "sync": sync,
            "update": 0.001, "step_time": 0.05, "timed_steps": timed}


def run_intervals(computes, threshold=0.2):
    """Three workers' compute per interval; the lines of each interval."""
    collectives = Gathering()
    watch = peers.PeerIntervals(collectives, threshold, host="node0")
    said = []
    for step, (c0, c1, c2) in enumerate(computes, start=1):
        collectives.theirs = {1: {**interval(c1), "host": "node1"},
                              2: {**interval(c2), "host": "node2"}}
        workers = watch.gather(interval(c0))
        said.append(watch.stragglers(workers, 10 * step, first=step == 1))
    return said, workers


def test_the_slow_worker_is_named_with_its_host_once_then_again_when_it_recovers():
    said, workers = run_intervals([(0.9, 0.9, 0.1),  # the first: compile
                                   (0.03, 0.10, 0.03), (0.03, 0.10, 0.03),
                                   (0.03, 0.03, 0.03), (0.03, 0.03, 0.03),
                                   (0.03, 0.03, 0.03)])
    assert said[0] == []  # compilation is not compared
    assert len(said[1]) == 1 and said[1][0].startswith(
        "straggler: worker 1 on node1: input + compute 101.0 ms a step "
        "(input 1.0, compute 100.0), 3.26x the other workers' median 31.0 ms "
        "over the last 1 interval(s) to step 20; they wait for it (their "
        "sync 2.0 ms a step)"), said
    assert said[2] == []  # not said again while it stays slow
    # Averaged over the last 3 intervals: (101 + 31 + 31) / 3 = 54 > 37.2.
    assert said[3] == [] and said[4] == []
    assert said[5] == ["worker 1 on node1 keeps pace again at step 60: input "
                       "+ compute 31.0 ms a step, the others' median 31.0 ms"]
    assert sorted(workers) == ["0", "1", "2"]
    assert workers["1"] == interval(0.03)  # the host kept aside


def test_within_the_threshold_no_worker_is_named():
    said, _ = run_intervals([(0.9, 0.9, 0.9)] + [(0.030, 0.035, 0.030)] * 4)
    assert said == [[]] * 5  # 1.16x < 1.2x
    said, _ = run_intervals([(0.9, 0.9, 0.9)] + [(0.03, 0.10, 0.03)] * 4,
                            threshold=0)
    assert said == [[]] * 5  # 0: never


def test_an_interval_without_timed_steps_is_not_compared():
    collectives = Gathering()
    collectives.theirs = {1: {**interval(0.5, timed=0), "host": "n1"},
                          2: {**interval(0.03, timed=0), "host": "n2"}}
    watch = peers.PeerIntervals(collectives, 0.2, host="n0")
    workers = watch.gather(interval(0.03, timed=0))
    assert watch.stragglers(workers, 20, first=False) == []


def test_a_worker_sends_its_numbers_and_keeps_nothing():
    collectives = Gathering(is_chief=False)
    watch = peers.PeerIntervals(collectives, 0.2, host="node1")
    assert watch.gather({**interval(0.04), "examples_per_second": 9.0}) is None
    assert collectives.sent == [("interval", {**interval(0.04),
                                              "host": "node1"})]


def test_one_worker_gathers_nothing():
    collectives = Gathering(num_workers=1)
    assert peers.PeerIntervals(collectives).gather(interval(0.1)) is None
    assert collectives.sent == []


def test_a_stall_is_said_after_a_minute_of_steps_ten_times_slower():
    watch = peers.StallWatch(factor=10, seconds=60)
    row = {"first": False, "steps": 100, "step_time": 0.05}
    assert watch.check({**row, "first": True, "step_time": 9.0}, 100) is None
    for step in (200, 300, 400):
        assert watch.check(row, step) is None
    slow = {**row, "steps": 10, "step_time": 1.0}  # 20x, 10 s an interval
    lines = [watch.check(slow, 400 + 10 * i) for i in range(1, 9)]
    assert lines[:5] == [None] * 5  # 50 s
    assert lines[5].startswith("steps have taken 1000 ms for 60 s to step "
                               "460, 20x this run's median 50.0 ms"), lines
    assert lines[6:] == [None, None]  # once
    assert watch.check(row, 600) is None  # recovered: said again next time


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mwms", "mpi"])
def test_a_worker_with_late_batches_is_named_in_the_log_its_numbers_and_tensorboard(
        tmp_path, backend):
    tensorboard = tmp_path / "tb"
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2",
         "--threads_per_worker", "1", "--backend", backend, "--",
         sys.executable, "-m", "tests.workers.train_worker", "--out",
         str(tmp_path), "--steps", "12", "--slow_worker", "0.1",
         "--backend", backend, "--tensorboard", str(tensorboard)],
        timeout=300)
    assert code == 0, output[-5000:]
    named = [line for line in output.splitlines()
             if "tfscale: straggler: worker 1 on " in line]
    assert len(named) == 1, output[-5000:]
    assert named[0].startswith("[worker 0] "), named  # the chief's
    chief = json.loads((tmp_path / "events_0.json").read_text())
    rows = [row for row in chief["intervals"] if not row["first"]]
    assert rows and all(sorted(row["workers"]) == ["0", "1"] for row in rows)
    for row in rows:
        late, prompt = row["workers"]["1"], row["workers"]["0"]
        # Worker 1 waits for its input; worker 0 waits for worker 1.
        assert late["input_wait"] > 3 * prompt["input_wait"], row
        assert prompt["sync"] > 3 * late["sync"], row
    other = json.loads((tmp_path / "events_1.json").read_text())
    assert all("workers" not in row for row in other["intervals"])
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator)
    events = EventAccumulator(str(tensorboard / "train"))
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"batch_worker0/sync", "batch_worker1/input_wait",
            "batch_worker1/compute"} <= tags, tags
    import tensorflow as tf
    late = [float(tf.make_ndarray(e.tensor_proto))
            for e in events.Tensors("batch_worker1/input_wait")]
    assert max(late) > 0.03, late
