"""Elastic runs' bookkeeping (launch/elastic.py) and tfscale-run's elastic
flags; the run itself, 3 -> 2 -> 3 hosts, is in test_hosts.py."""

import io
import os
import re
import sys

import pytest

from launch import elastic, horovodrun, local


def config(**kwargs):
    return elastic.ElasticConfig(**{**dict(
        min_np=2, max_np=3, discovery_script="./hosts.sh", poll_seconds=5,
        timeout_seconds=10), **kwargs})


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_discovery_output_is_read_as_horovod_reads_it():
    assert elastic.parse_hosts("node1:2\n# a comment\n\nnode2\nnode1:2\n",
                               slots_per_host=4, script="s") == [
        ("node1", 2), ("node2", 4)]
    with pytest.raises(elastic.DiscoveryError,
                       match=r"--host-discovery-script s: line 2 is "
                             r"'node2:x', not 'host:slots' or 'host'"):
        elastic.parse_hosts("node1\nnode2:x\n", 1, "s")


def test_the_script_is_run_and_its_failure_named(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho node1:1\necho node2\n")
    script.chmod(0o755)
    assert elastic.discover(config(discovery_script=str(script))) == [
        ("node1", 1), ("node2", 1)]
    script.write_text("#!/bin/sh\necho 'no scheduler' >&2\nexit 3\n")
    with pytest.raises(elastic.DiscoveryError,
                       match=r"hosts.sh exited 3: no scheduler"):
        elastic.discover(config(discovery_script=str(script)))


def test_ranks_are_capped_at_max_np_and_failing_hosts_left_out():
    found = [("node1", 2), ("node2", 2), ("node3", 1)]
    membership = elastic.Membership(config(max_np=3), find=lambda: found)
    assert membership.next_hosts() == [("node1", 2), ("node2", 1)]
    assert membership.num_workers == 3
    # Rank 2 is node2's (--map-by slot); it lost no peer itself.
    assert membership.failed(2) == "node2 has failed 1 time(s)"
    assert membership.failed(2) == ("node2 has failed 2 time(s): left out "
                                    "from now on")
    before = list(membership.hosts)
    assert membership.next_hosts() == [("node1", 2), ("node3", 1)]
    assert membership.changes(before) == ("node2 left out after failing; "
                                          "node3 joined")


def test_a_rank_that_only_lost_a_peer_charges_the_peers_host():
    membership = elastic.Membership(config(), find=lambda: [
        ("node1", 1), ("node2", 1), ("node3", 1)])
    membership.next_hosts()
    assert membership.failed(0, {0: "node3"}) == "node3 has failed 1 time(s)"
    assert membership.failed(0, {0: None}) == ""  # MPI did not say whose
    assert membership.failed(None) == ""


def test_too_few_hosts_wait_out_the_timeout_then_name_what_is_missing(
        monkeypatch):
    clock = Clock()
    monkeypatch.setattr(elastic.time, "sleep",
                        lambda s: setattr(clock, "now", clock.now + s))
    membership = elastic.Membership(config(), find=lambda: [("node1", 1)],
                                    clock=clock)
    assert membership.next_hosts() is None
    assert clock.now >= 10
    assert membership.too_few() == ("fewer than --min-np 2 slots for 10 s "
                                    "(found: node1:1)")


def test_a_host_that_joins_or_leaves_is_a_change_polled_at_its_interval():
    clock = Clock()
    found = [("node1", 1), ("node2", 1)]
    membership = elastic.Membership(config(), find=lambda: list(found),
                                    clock=clock)
    membership.next_hosts()
    found.append(("node3", 1))
    assert membership.change() is None  # polled at most every 5 s
    clock.now = 5
    assert membership.change() == "node3 joined the discovery output"
    membership.next_hosts()
    found[:] = [("node1", 1), ("node3", 1)]
    clock.now = 10
    assert membership.change() == "node2 left the discovery output"

    def broken():
        raise elastic.DiscoveryError("script failed")
    membership._find = broken
    clock.now = 20
    assert membership.change() is None  # the running hosts go on


def test_at_max_np_a_new_host_is_no_change():
    clock = Clock()
    found = [("node1", 1), ("node2", 1), ("node3", 1)]
    membership = elastic.Membership(config(max_np=2),
                                    find=lambda: list(found), clock=clock)
    membership.next_hosts()
    found.append(("node4", 1))
    clock.now = 5
    assert membership.change() is None


class FakeGroup:
    """A group whose first attempt fails on rank 2; the next succeeds."""

    def __init__(self, failure):
        self.failure, self.lost_peer, self.last_lines = failure, {}, {}
        self.hung, self.held_back, self.checkpoints = {}, [], []
        self.procs = []

    def first_failure(self):
        return self.failure

    def all_done(self):
        return True

    def stop(self, grace_seconds, sig=None, hurry=None):
        return []

    def mute(self):
        pass


def test_the_launcher_restarts_on_the_hosts_left_and_ends_below_the_minimum():
    found = [("node1", 1), ("node2", 1), ("node3", 1)]
    membership = elastic.Membership(config(host_failures=1, timeout_seconds=0),
                                    find=lambda: list(found))
    plan = elastic.Elastic(membership, lambda hosts: [])
    attempts = []

    def start():
        attempts.append(list(membership.hosts))
        # Rank 2, then rank 1: each host fails once and is left out.
        return FakeGroup((len(membership.hosts) - 1, 9))
    out = io.StringIO()
    code = local._supervise(
        local.LaunchConfig(3, backend="mpi", max_restarts=5,
                           restart_backoff_seconds=0),
        start, [], out, elastic=plan)
    lines = out.getvalue().splitlines()
    assert attempts == [found, found[:2]], lines
    assert "[launcher] elastic: node3 has failed 1 time(s): left out from " \
        "now on" in lines
    assert lines[-1] == ("[launcher] exit 9: fewer than --min-np 2 slots for "
                         "0 s (found: node1:1; left out after failing: "
                         "node2, node3)")
    assert code == 9


def test_tfscale_run_takes_horovods_elastic_flags(capsys):
    args = horovodrun.parse_args([
        "--min-np", "2", "--max-np", "4", "--host-discovery-script",
        "./hosts.sh", "--slots", "2", "--reset-limit", "3", "python", "t.py"])
    cfg = horovodrun.elastic_config(args)
    assert (cfg.min_np, cfg.max_np, cfg.slots_per_host) == (2, 4, 2)
    assert args.num_proc == 2 and args.max_restarts == 3
    for argv, message in [
            (["--min-np", "2", "-np", "2"], "need --host-discovery-script"),
            (["--host-discovery-script", "h", "-H", "a:1", "-np", "1"],
             "no -H or --hostfile"),
            (["--host-discovery-script", "h", "--min-np", "3",
              "--max-np", "2"], "need 1 <= min <= max"),
            (["--host-discovery-script", "h", "--min-np", "1",
              "--discovery-interval", "-1"], "--discovery-interval"),
            (["--host-discovery-script", "h", "--min-np", "1",
              "--elastic-timeout", "nan"], "--elastic-timeout")]:
        with pytest.raises(SystemExit):
            horovodrun.parse_args([*argv, "python", "t.py"])
        assert message in capsys.readouterr().err, message


def test_a_failing_discovery_script_ends_tfscale_run_in_one_line(
        tmp_path, capsys):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\nexit 4\n")
    script.chmod(0o755)
    code = horovodrun.main(["--min-np", "1", "--max-np", "2",
                            "--host-discovery-script", str(script),
                            sys.executable, "-c", "pass"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"tfscale-run: error: --host-discovery-script {script} exited 4")


# Worker slot 2 (its port, launch.local --port P: P + 2) always fails, as
# a worker on a GPU gone bad would; the others finish.
BAD_SLOT = ("import json, os, sys, time\n"
            "me = json.loads(os.environ['TF_CONFIG'])\n"
            "port = int(me['cluster']['worker'][me['task']['index']]"
            ".rsplit(':', 1)[1])\n"
            "print('slot port', port, flush=True)\n"
            "time.sleep(0.3)\n"
            "sys.exit(5 if port == int(sys.argv[1]) + 2 else 0)\n")


def test_one_host_leaves_out_a_slot_that_keeps_failing(tmp_path):
    from launch import ports
    from tests.test_launch import launch
    base = 30000 + os.getpid() % 20000  # three free ports from there
    while ports.taken([base, base + 1, base + 2]):
        base += 3
    code, output = launch(
        ["--num_workers", "3", "--min_workers", "2", "--port", str(base),
         "--max_restarts", "3", "--restart_backoff_seconds", "0",
         "--", sys.executable, "-c", BAD_SLOT, str(base), str(tmp_path)],
        timeout=120)
    assert code == 0, output
    lines = [line for line in output.splitlines()
             if line.startswith("[launcher]")]
    assert "[launcher] elastic: slot2 has failed 1 time(s)" in lines
    assert ("[launcher] elastic: slot2 has failed 2 time(s): left out from "
            "now on") in lines
    assert ("[launcher] elastic: 2 workers on slot0:1,slot1:1 (slot2 left "
            "out after failing): from the last whole checkpoint, at the "
            "job's global batch (its banner says the split)") in lines
    # The slots left keep their ports.
    last = output.split("slot2 left out after failing")[1]
    assert sorted(set(re.findall(r"slot port (\d+)", last))) == [
        str(base), str(base + 1)]
    assert lines[-1] == "[launcher] exit 0: every worker finished"


def test_below_min_workers_the_job_ends_naming_the_slots(tmp_path):
    from tests.test_launch import launch
    code, output = launch(
        ["--num_workers", "2", "--min_workers", "2", "--max_restarts", "3",
         "--restart_backoff_seconds", "0", "--", sys.executable, "-c",
         "import os, sys; sys.exit(7 if os.environ['TFSCALE_WORKER_INDEX']"
         " == '1' else 0)", str(tmp_path)], timeout=120)
    assert code == 7, output
    assert output.rstrip().splitlines()[-1] == (
        "[launcher] exit 7: fewer than --min_workers 2 slots for 0 s "
        "(found: slot0:1; left out after failing: slot1)")


def test_min_workers_is_checked():
    with pytest.raises(ValueError, match="--min_workers must be between 1 "
                       "and --num_workers"):
        local.LaunchConfig(2, min_workers=3)
    with pytest.raises(ValueError, match="tfscale-run --min-np"):
        local.LaunchConfig(2, min_workers=1, backend="mpi")


class Proc:
    def __init__(self, returncode):
        self.returncode = returncode


class MovingGroup(FakeGroup):
    """An attempt that trains until the launcher stops it, then shows
    `codes` and the checkpoints its workers reported."""

    def __init__(self, codes, checkpoints=()):
        super().__init__(None)
        self.procs = [Proc(None) for _ in codes]
        self._codes, self.checkpoints = codes, list(checkpoints)
        self.stopped = False

    def all_done(self):
        return self.stopped

    def stop(self, grace_seconds, sig=None, hurry=None):
        self.stopped = True
        for proc, code in zip(self.procs, self._codes):
            proc.returncode = code
        return []


def moving(findings, groups, tmp_path, interrupted=()):
    """Runs the supervisor over hosts found in turn (`findings`: each
    discovery's answer, the last repeated) and attempts (`groups`);
    (exit code, the launcher's lines)."""
    calls = []

    def find():
        calls.append(1)
        return list(findings[min(len(calls) - 1, len(findings) - 1)])
    membership = elastic.Membership(
        config(poll_seconds=0.01, timeout_seconds=0), find=find)
    out = io.StringIO()
    code = local._supervise(
        local.LaunchConfig(3, backend="mpi", max_restarts=2,
                           restart_backoff_seconds=0, grace_seconds=1),
        lambda: groups.pop(0), list(interrupted), out,
        elastic=elastic.Elastic(membership, lambda hosts: []))
    return code, out.getvalue().splitlines()


TWO = [("node1", 1), ("node2", 1)]
THREE = TWO + [("node3", 1)]


def whole_checkpoint(tmp_path, step):
    prefix = str(tmp_path / f"ckpt-{step}")
    for end in (".index", ".data-00000-of-00001"):
        open(prefix + end, "w").close()
    return prefix


def test_a_move_that_saved_restarts_on_the_new_hosts_and_finishes(tmp_path):
    saved = whole_checkpoint(tmp_path, 5)
    code, lines = moving([TWO, THREE], [
        MovingGroup([143, 143], [saved]), FakeGroup(None)], tmp_path)
    assert code == 0, lines
    assert ("[launcher] elastic: node3 joined the discovery output: every "
            "worker saves at its next step and leaves, then the job "
            "restarts on the hosts found") in lines
    assert f"[launcher] elastic: ckpt-5 complete on disk ({saved}): the " \
        "restart resumes there" in lines
    assert lines[-1] == "[launcher] exit 0: every worker finished"


def test_a_move_with_nothing_saved_ends_the_job_with_the_workers_code(
        tmp_path):
    # Exit 3 from every worker: no checkpoint folder, a restart would
    # start over.
    code, lines = moving([TWO, THREE], [MovingGroup([3, 3])], tmp_path)
    assert code == 3, lines
    assert lines[-1].startswith("[launcher] exit 3: nothing saved: an "
                                "elastic job needs a checkpoint folder")


def test_too_few_hosts_after_a_saved_move_ends_with_the_workers_143(
        tmp_path):
    # node2 left; the hosts left are below --min-np 2: the checkpoint the
    # workers reported stands, and 143 tells a scheduler to requeue.
    saved = whole_checkpoint(tmp_path, 7)
    code, lines = moving([TWO, [("node1", 1)]],
                         [MovingGroup([143, 143], [saved])], tmp_path)
    assert code == 143, lines
    assert lines[-1] == ("[launcher] exit 143: fewer than --min-np 2 slots "
                         "for 0 s (found: node1:1)")


def test_no_hosts_at_all_is_exit_2_and_a_signal_while_waiting_its_own(
        tmp_path):
    code, lines = moving([[("node1", 1)]], [], tmp_path)
    assert code == 2, lines  # no worker ran: a setting, not a failure
    assert lines[-1] == ("[launcher] exit 2: fewer than --min-np 2 slots for "
                         "0 s (found: node1:1)")
    import signal
    code, lines = moving([[("node1", 1)]], [], tmp_path,
                         interrupted=[signal.SIGTERM])
    assert code == 143, lines
    assert lines[-1] == ("[launcher] exit 143: SIGTERM while waiting for "
                         "hosts: no worker was running; the latest "
                         "checkpoint stands")
