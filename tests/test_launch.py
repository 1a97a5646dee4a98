"""launch.local: pure command/env building, and real process supervision."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from launch import children, local, mpi_ranks, ports, workers
from tests.conftest import REPO, run_command


def test_worker_specs_give_each_worker_its_tf_config():
    specs = local.worker_specs(["python", "train.py"], 3, [11, 12, 13],
                               {"PATH": "/bin", "TF_CONFIG": "stale"},
                               threads_per_worker=2)
    assert [s.index for s in specs] == [0, 1, 2]
    for spec in specs:
        config = json.loads(spec.env["TF_CONFIG"])
        assert config["cluster"] == {"worker": ["127.0.0.1:11", "127.0.0.1:12",
                                                "127.0.0.1:13"]}
        assert config["task"] == {"type": "worker", "index": spec.index}
        assert spec.env["TF_NUM_INTRAOP_THREADS"] == "2"
        assert spec.env["PATH"] == "/bin"
        assert spec.command == ["python", "train.py"]


def test_single_worker_gets_no_tf_config():
    (spec,) = local.worker_specs(["x"], 1, [5], {"TF_CONFIG": "stale"})
    assert "TF_CONFIG" not in spec.env


@pytest.mark.parametrize("args, message", [
    ((["x"], 2, [1]), "need 2 distinct ports"),
    ((["x"], 2, [1, 1]), "need 2 distinct ports"),
    (([], 1, [1]), "no command"),
    ((["x"], 0, []), "--num_workers must be >= 1"),
])
def test_worker_specs_reject_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        local.worker_specs(*args, base_env={})


def test_free_ports_are_distinct():
    assert len(set(ports.find_free_ports(4))) == 4
    with ports.lease(4) as held:
        assert len(set(held.ports)) == 4


def offering(monkeypatch, *candidates):
    """Makes the free-port search offer `candidates` first, in order (as
    the kernel may, to two launchers at once), then any free port."""
    queue = list(candidates)
    search = ports.find_free_ports
    monkeypatch.setattr(ports, "find_free_ports", lambda count, host: (
        [queue.pop(0)] if queue else search(count, host)))


def test_a_port_another_lease_holds_is_skipped_until_it_is_released(
        monkeypatch, tmp_path):
    folder = str(tmp_path / "locks")
    first = ports.lease(2, folder=folder)
    offering(monkeypatch, *first.ports)
    with ports.lease(2, folder=folder) as second:
        assert not set(second.ports) & set(first.ports)
    first.close()
    offering(monkeypatch, *first.ports)
    with ports.lease(2, folder=folder) as third:
        assert third.ports == first.ports


def test_a_lease_dies_with_its_process(monkeypatch, tmp_path):
    """A launcher killed with -9 holds nothing: the kernel drops its locks."""
    folder = str(tmp_path / "locks")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from launch import ports; "
         "held = ports.lease(1, folder=sys.argv[1]); print(held.ports[0], "
         "flush=True); time.sleep(600)", folder], cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        text=True)
    try:
        port = int(holder.stdout.readline())
        offering(monkeypatch, port)
        with ports.lease(1, folder=folder) as other:
            assert other.ports != [port]
    finally:
        holder.kill()
        holder.wait()
    offering(monkeypatch, port)
    with ports.lease(1, folder=folder) as other:
        assert other.ports == [port]


def test_without_a_lock_folder_a_lease_is_the_plain_search(tmp_path):
    (tmp_path / "file").write_text("")  # a read-only /tmp, as far as it goes
    with ports.lease(3, folder=str(tmp_path / "file" / "locks")) as held:
        assert len(set(held.ports)) == 3


def test_a_lease_names_the_folder_when_every_port_is_held(monkeypatch,
                                                          tmp_path):
    folder = str(tmp_path / "locks")
    with ports.lease(1, folder=folder) as held:
        monkeypatch.setattr(ports, "find_free_ports",
                            lambda count, host: list(held.ports))
        with pytest.raises(RuntimeError, match=r"found 0 of 1 free ports "
                           r"on 127\.0\.0\.1: the others were held by "
                           r"other launchers \(locks in .*locks\)"):
            ports.lease(1, folder=folder)


def test_cli_requires_a_command(capsys):
    with pytest.raises(SystemExit):
        local.parse_args(["--num_workers", "2"])
    assert "after '--'" in capsys.readouterr().err
    args = local.parse_args(["--num_workers", "2", "--max_restarts", "1", "--",
                             "python", "x.py", "--flag"])
    assert args.command == ["python", "x.py", "--flag"]


def test_exit_codes_follow_the_shell():
    assert children.shell_code(-9) == 137 and children.shell_code(3) == 3
    assert children.describe_exit(-9) == "killed by SIGKILL"


def processes_mentioning(token):
    """PIDs whose command line contains `token` (the process table)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def launch(args, timeout=120):
    return run_command([sys.executable, "-m", "launch.local", *args],
                       timeout=timeout)


WORKER_SCRIPT = (
    "import os, sys, time\n"
    "index = int(os.environ['TFSCALE_WORKER_INDEX'])\n"
    "print('hello from', index, flush=True)\n"
    "marker = sys.argv[1]\n"
    "if index == 1 and not os.path.exists(marker):\n"
    "    open(marker, 'w').close(); sys.exit(7)\n"
    "if index == 0 and sys.argv[2] == 'hang':\n"
    "    time.sleep(600)\n")


@pytest.mark.slow
def test_failed_worker_stops_the_others_and_sets_the_exit_code(tmp_path):
    token = str(tmp_path / "marker")
    start = time.monotonic()
    code, output = launch(["--num_workers", "2", "--grace_seconds", "2", "--",
                           sys.executable, "-c", WORKER_SCRIPT, token, "hang"])
    assert code == 7
    assert time.monotonic() - start < 60  # not the worker's 600 s
    assert "[worker 0] hello from 0" in output
    assert "[launcher] worker 1 failed (exit code 7)" in output
    # The launcher's last line names its exit code and why.
    assert output.rstrip().endswith(
        "[launcher] exit 7: worker 1 failed (exit code 7)"), output[-2000:]
    assert processes_mentioning(token) == []


@pytest.mark.slow
def test_restart_after_a_failure_then_success(tmp_path):
    token = str(tmp_path / "marker")
    code, output = launch(["--num_workers", "2", "--max_restarts", "1", "--",
                           sys.executable, "-c", WORKER_SCRIPT, token, "ok"])
    assert code == 0, output
    assert ("restart 1/1: starting 2 workers again in 1 s (cause: worker 1 exit "
            "code 7)") in output
    assert output.count("[worker 1] hello from 1") == 2
    assert output.rstrip().endswith("[launcher] exit 0: every worker finished")


def train_worker(out, *args):
    return [sys.executable, "-m", "tests.workers.train_worker", "--out",
            str(out), *args]


@pytest.mark.slow
def test_ctrl_c_stops_all_workers_and_leaves_a_restorable_checkpoint(tmp_path):
    import tensorflow as tf
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, "-m", "launch.local", "--num_workers", "2",
               "--threads_per_worker", "1", "--",
               *train_worker(tmp_path, "--steps", "100000",
                             "--checkpoint_dir", str(ckpt), "--save_steps",
                             "3")]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while tf.train.latest_checkpoint(str(ckpt)) is None:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)  # polling for a file, not synchronizing on time
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-3000:]
    assert "SIGINT: passing it to all workers" in output
    assert processes_mentioning(str(tmp_path)) == []
    # Both workers save the step they agree on (not just the last periodic
    # save), then stop with KeyboardInterrupt.
    # Each names the chief's checkpoint of that step (before: worker 1
    # named the one it had restored, or none).
    saved = re.findall(r"\[worker (\d)\] .*interrupted \(SIGINT\) at step "
                       r"(\d+): saved (\S+)", output)
    assert sorted(i for i, _, _ in saved) == ["0", "1"], output[-3000:]
    latest = tf.train.latest_checkpoint(str(ckpt))
    assert {(s, p) for _, s, p in saved} == {(latest.rsplit("-", 1)[1],
                                             latest)}
    reader = tf.train.load_checkpoint(latest)
    step = reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE")
    assert step == int(saved[0][1]) >= 3
    assert output.rstrip().splitlines()[-1].startswith(
        f"[launcher] exit 130: stopped by SIGINT: "
        f"{os.path.basename(latest)} complete on disk"), output[-2000:]


@pytest.mark.slow
def test_slurm_environment_runs_two_workers(tmp_path):
    """Two tasks as srun would start them: SLURM variables, no TF_CONFIG."""
    base = ports.find_free_ports(1)[0]
    env = dict(os.environ, PYTHONPATH=REPO, SLURM_NTASKS="2",
               SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
               SLURM_STEP_TASKS_PER_NODE="2", TF_NUM_INTRAOP_THREADS="1")
    env.pop("TF_CONFIG", None)
    procs = [subprocess.Popen(
        train_worker(tmp_path, "--slurm_port_base", str(base)), cwd=REPO,
        env=dict(env, SLURM_PROCID=str(i)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    one = tmp_path / "one"
    one.mkdir()
    code, output = run_command(train_worker(one), timeout=180,
                               env={"TF_NUM_INTRAOP_THREADS": "1"})
    assert code == 0, output
    a, b = np.load(tmp_path / "weights_0.npz"), np.load(one / "weights_0.npz")
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    events = json.loads((tmp_path / "events_1.json").read_text())
    assert events["is_chief"] is False


def test_a_port_of_ports_range_in_use_ends_the_launch_without_restarts(
        tmp_path):
    # Before: each of 4 attempts died on "cannot listen on ... (Address
    # already in use)"; a restart cannot free another program's port.
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        code, output = launch(["--num_workers", "2", "--port", str(port - 1),
                               "--max_restarts", "3", "--", sys.executable,
                               "-c", "print('started')"], timeout=60)
    finally:
        taken.close()
    assert code == 2, output
    assert output.strip().splitlines() == [
        f"[launcher] exit 2: port {port} on 127.0.0.1 is in use by another "
        f"program (--port {port - 1} gives workers ports {port - 1}-{port}): "
        "choose other ports or leave --port out (free ones are found)"]


def test_a_leased_port_taken_between_attempts_is_replaced():
    import io
    import socket
    config = local.LaunchConfig(2)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    out = io.StringIO()
    try:
        with ports.lease(2) as spare:
            fresh = local.usable_ports(config, [busy, busy + 1], out,
                                       lambda n, host: spare.ports)
            assert fresh == spare.ports
            assert local.usable_ports(config, fresh, out, None) == fresh
    finally:
        taken.close()
    assert out.getvalue() == (
        f"[launcher] port(s) {busy} taken by another program: the workers "
        f"listen on {fresh[0]}, {fresh[1]}\n")


def test_restarts_wait_longer_each_time_up_to_a_cap(tmp_path):
    config = local.LaunchConfig(1, max_restarts=9,
                                restart_backoff_seconds=1.5,
                                max_backoff_seconds=10)
    assert [local.backoff_seconds(config, a) for a in range(5)] == [
        1.5, 3, 6, 10, 10]
    code, output = launch(["--num_workers", "1", "--max_restarts", "3",
                           "--restart_backoff_seconds", "0.2",
                           "--max_backoff_seconds", "0.5", "--",
                           sys.executable, "-c", "raise SystemExit(9)"],
                          timeout=60)
    assert code == 9
    waits = re.findall(r"restart \d/3: starting 1 worker again in ([\d.]+) s",
                       output)
    assert waits == ["0.2", "0.4", "0.5"], output
    assert output.rstrip().endswith(
        "[launcher] exit 9: worker 0 failed (exit code 9), in the last of 4 "
        "attempts"), output


def test_negative_max_restarts_is_a_one_line_error(capsys):
    with pytest.raises(ValueError, match="--max_restarts must be >= 0"):
        local.run(["true"], 1, max_restarts=-1)
    with pytest.raises(SystemExit):
        local.parse_args(["--num_workers", "1", "--max_restarts", "-1", "--",
                          "true"])
    assert "--max_restarts must be >= 0" in capsys.readouterr().err


SLEEPER = ("import signal, sys, time\n"
           "def term(*_):\n"
           "    open(sys.argv[1] + '.' + __import__('os').environ["
           "'TFSCALE_WORKER_INDEX'], 'w').close()\n"
           "    if len(sys.argv) > 2: time.sleep(float(sys.argv[2]))\n"
           "    sys.exit(143)\n"
           "signal.signal(signal.SIGTERM, term)\n"
           "print('ready', flush=True)\n"
           "time.sleep(600)\n")


def start_sleepers(tmp_path, *launcher_args, save_seconds=None):
    """Two workers that exit 143 on SIGTERM (after `save_seconds`, as a
    slow save would)."""
    marker = str(tmp_path / "sigterm")
    saving = [] if save_seconds is None else [str(save_seconds)]
    command = [sys.executable, "-m", "launch.local", "--num_workers", "2",
               *launcher_args, "--", sys.executable, "-c", SLEEPER, marker,
               *saving]
    proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ,
                                                        PYTHONPATH=REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ready = 0
    while ready < 2:  # each worker prints 'ready' once its handler is set
        line = proc.stdout.readline()
        assert line, "launcher ended early"
        ready += "ready" in line
    return proc, marker


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path):
    proc, marker = start_sleepers(tmp_path)
    assert len(processes_mentioning(marker)) == 3  # launcher + 2 workers
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting for the kernel to reap them
    assert processes_mentioning(marker) == []


@pytest.mark.slow
def test_sigterm_reaches_every_worker_and_exits_143(tmp_path):
    proc, marker = start_sleepers(tmp_path)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    assert "SIGTERM: passing it to all workers" in output
    assert os.path.exists(marker + ".0") and os.path.exists(marker + ".1")
    assert processes_mentioning(marker) == []


def test_a_grace_that_runs_out_is_said_and_is_not_a_saved_preemption(
        tmp_path):
    # The workers take 30 s to "save"; the launcher gives them 1 s: it
    # SIGKILLs them, says so, and exits 137, not 143 (which a scheduler
    # reads as "checkpoint saved").
    proc, marker = start_sleepers(tmp_path, "--grace_seconds", "1",
                                  save_seconds=30)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 137, output
    assert ("[launcher] the grace of 1 s ran out: SIGKILLed worker 0, "
            "worker 1 before it finished") in output, output
    assert output.rstrip().endswith(
        "[launcher] exit 137: killed after the grace: a checkpoint may be "
        "missing"), output[-2000:]
    assert processes_mentioning(marker) == []


CONFIG_ERROR = ("import os, sys\n"
                "print('started', os.environ['TFSCALE_WORKER_INDEX'], "
                "flush=True)\n"
                "if os.environ['TFSCALE_WORKER_INDEX'] == '1':\n"
                "    sys.stderr.write('job: error: --flag: bad value\\n')\n"
                "    sys.exit(2)\n"
                "import time; time.sleep(600)\n")


def test_a_configuration_error_is_not_restarted(tmp_path):
    code, output = launch(["--num_workers", "2", "--max_restarts", "3",
                           "--failure_grace_seconds", "1", "--",
                           sys.executable, "-c", CONFIG_ERROR,
                           str(tmp_path)])
    assert code == 2, output
    assert ("[launcher] worker 1 stopped on an error a restart would repeat "
            "(exit 2): job: error: --flag: bad value; stopping the other "
            "workers, no restart") in output, output
    assert "restart 1/3" not in output
    assert output.count("started 1") == 1


def test_the_templates_grace_holds_the_default_call_bound():
    """SLURM's --signal lead and Kubernetes' terminationGracePeriodSeconds
    hold the worst case from SIGTERM to the checkpoint with room: the call
    in flight (the default --max_call_seconds), a step and the save."""
    import glob
    import re
    from tfscale.train_config import TrainConfig
    bound = TrainConfig(global_batch_size=1).max_call_seconds
    leads = []
    for path in glob.glob(os.path.join(REPO, "launch", "slurm*.sbatch")):
        found = re.search(r"#SBATCH --signal=(?:B:)?(?:TERM|USR1)@(\d+)",
                          open(path).read())
        if found:
            leads.append(int(found.group(1)))
    assert len(leads) >= 4 and min(leads) >= 30 * bound, leads
    yaml = open(os.path.join(REPO, "launch", "kubernetes.yaml")).read()
    grace = int(re.search(r"terminationGracePeriodSeconds: (\d+)",
                          yaml).group(1))
    assert grace >= 30 and grace >= 15 * bound
    assert local.LaunchConfig(1).grace_seconds >= 15 * bound


def test_a_rank_that_aborts_on_a_lost_peer_is_called_a_victim():
    """Across hosts Open MPI may report the rank that lost its connection to
    a killed peer before the killed one: the launcher says so, with the
    peer's host when Open MPI names it."""
    import io
    for said, expected in (
            ("[1,0]<stderr>:   Peer host:  node2",
             "it lost its MPI peer on node2 (a rank there died or was "
             "killed first)"),
            ("[1,0]<stderr>: [node1:00000] *** An error occurred in Socket "
             "closed", "it lost an MPI connection (another rank died or was "
             "killed first; mpirun names the first rank to abort)"),
            ("[1,0]<stderr>: ValueError: bad value",
             "ValueError: bad value")):
        script = (f"echo '{said}'; echo 'prterun has exited due to process "
                  "rank 0 with PID 0 on node node1 calling \"abort\".'; "
                  "exit 14")
        out = io.StringIO()
        group = mpi_ranks.MpiGroup(["sh", "-c", script], dict(os.environ), out)
        group.proc.wait()
        index, code = group.first_failure()
        assert (index, code) == (0, 14), out.getvalue()
        assert workers.last_words(group, index, code) == f": {expected}"


def test_a_worker_that_lost_its_peer_is_not_named_as_the_cause():
    """Worker 1 is killed; worker 0's collective loses it and worker 0
    leaves at once with tfscale's line naming the peer. On a loaded host the
    launcher can see worker 0's exit first (here it comes 0.5 s first): the
    launcher still names worker 1, and restarts on its cause."""
    script = (
        "import os, signal, sys, time\n"
        "if os.environ['TFSCALE_WORKER_INDEX'] == '1':\n"
        "    time.sleep(1.5); os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(1)\n"
        "print('tfscale: worker 0 failed: UnavailableError: Collective ops "
        "is aborted by: recvmsg:Connection reset by peer (lost peer: worker "
        "1); ending the job', flush=True)\n"
        "sys.exit(1)\n")
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2", "--",
         sys.executable, "-c", script], timeout=60)
    assert code == 137, output
    assert "worker 1 failed (killed by SIGKILL)" in output, output
    assert "worker 0 failed (" not in output, output


def test_after_a_failure_the_others_get_sigterm_and_time_to_finish_a_write(
        tmp_path):
    # Worker 1 fails; worker 0 is writing a file when the launcher stops
    # it: SIGTERM first, SIGKILL only after --failure_grace_seconds, so the
    # write ends (a killed backup writer would leave half a file).
    done = tmp_path / "written"
    script = (
        "import os, signal, sys, time\n"
        "if os.environ['TFSCALE_WORKER_INDEX'] == '1':\n"
        "    time.sleep(1); sys.exit(5)\n"
        "def finish(*_):\n"
        "    time.sleep(1.5)  # the rest of a write\n"
        f"    open({str(done)!r}, 'w').write('whole'); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, finish)\n"
        "while True: time.sleep(0.1)\n")
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2",
         "--failure_grace_seconds", "10", "--", sys.executable, "-c",
         script], timeout=60)
    assert code == 5, output
    assert "worker 1 failed (exit code 5)" in output
    assert done.read_text() == "whole"


def test_help_explains_every_option_with_its_default():
    """`--help` exits 0 with or without a command after '--', and every
    option has a help text that says its default."""
    for argv in (["--help"], ["-h", "--num_workers", "2"],
                 ["--help", "--", "python", "x.py"]):
        proc = subprocess.run([sys.executable, "-m", "launch.local", *argv],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert "--num_workers" in proc.stdout
    for action in local._parser()._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
        assert "default" in action.help or action.required, action.dest


NOISY_SURVIVOR = (
    "import os, signal, sys, time\n"
    "if os.environ['TFSCALE_WORKER_INDEX'] == '1':\n"
    "    time.sleep(1); print('worker 1: the real error', flush=True)\n"
    "    sys.exit(5)\n"
    "def lost(*_):\n"
    "    for i in range(60):\n"
    "        print(f'grpc traceback line {i}', flush=True)\n"
    "    sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, lost)\n"
    "while True: time.sleep(0.1)\n")


def test_a_failures_line_is_not_buried_under_its_peers_tracebacks():
    """Worker 1 fails; worker 0, stopped, prints 60 lines about the peer
    it lost: held back, one line says so, the launcher's line stays the
    last word about the failure."""
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2", "--",
         sys.executable, "-c", NOISY_SURVIVOR], timeout=60)
    assert code == 5, output
    assert "worker 1 failed (exit code 5): worker 1: the real error" in output
    assert "grpc traceback line 3" not in output
    assert ("60 line(s) worker 0 printed while stopping held back (their "
            "side of the failure); the last: grpc traceback line 59") in output


def test_the_launchers_code_after_a_signal_is_the_workers_outcome():
    from launch import outcome
    assert outcome.after_signal([143, 143], "/r/ckpt-121", 143) == (
        143, "preempted: ckpt-121 complete on disk (/r/ckpt-121); rerun "
             "the same command to resume")
    code, line = outcome.after_signal([143, 3], None, 143)
    assert code == 3 and line.startswith("nothing saved: worker 1 had no "
                                         "checkpoint directory")
    code, line = outcome.after_signal([143, 1], "/r/ckpt-121", 143)
    assert code == 1 and line.startswith("worker 1 failed while stopping "
                                         "(exit 1)")
    assert outcome.after_signal([0, 0], None, 143)[0] == 0
    code, line = outcome.after_signal([143, 143], None, 143)
    assert code == 143 and "none new written" in line


UNSAVED = ("import signal, sys, time\n"
           "def term(*_):\n"
           "    print('tfscale: no checkpoint directory: nothing saved; "
           "exiting with code 3', flush=True)\n"
           "    sys.exit(3)\n"
           "signal.signal(signal.SIGTERM, term)\n"
           "print('ready', flush=True)\n"
           "time.sleep(600)\n")

SAVED = ("import os, signal, sys, time\n"
         "prefix = os.path.join(sys.argv[1], 'ckpt-7')\n"
         "def term(*_):\n"
         "    if os.environ['TFSCALE_WORKER_INDEX'] == '0':\n"
         "        for end in ('.index', '.data-00000-of-00001'):\n"
         "            open(prefix + end, 'w').close()\n"
         "        print('tfscale: preemption checkpoint complete: ' + prefix "
         "+ ' (step 7, SIGTERM)', flush=True)\n"
         "    sys.exit(143)\n"
         "signal.signal(signal.SIGTERM, term)\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n")


@pytest.mark.parametrize("script,code,closing", [
    # Before: 143 ("checkpoint on disk") after the worker said it saved
    # nothing (mutation tried: the outcome removed -> 143 here).
    (UNSAVED, 3, "[launcher] exit 3: nothing saved: worker 0 had no "
                 "checkpoint directory; a rerun starts over"),
    (SAVED, 143, "[launcher] exit 143: preempted: ckpt-7 complete on disk ("),
], ids=["nothing saved", "saved"])
def test_a_signalled_launcher_exits_with_what_its_workers_did(
        tmp_path, script, code, closing):
    command = [sys.executable, "-m", "launch.local", "--num_workers", "2",
               "--", sys.executable, "-c", script, str(tmp_path)]
    proc = subprocess.Popen(command, cwd=REPO, env=dict(
        os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, "launcher ended early"
        ready += "ready" in line
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, output
    # The launcher's last line.
    assert output.rstrip().splitlines()[-1].startswith(closing), output


SELF_PREEMPTED = ("import os, sys\n"
                  "prefix = os.path.join(sys.argv[1], 'ckpt-5')\n"
                  "if len(sys.argv) > 2 and "
                  "os.environ['TFSCALE_WORKER_INDEX'] == '0':\n"
                  "    for end in ('.index', '.data-00000-of-00001'):\n"
                  "        open(prefix + end, 'w').close()\n"
                  "    print('tfscale: preemption checkpoint complete: ' + "
                  "prefix + ' (step 5, SIGTERM)', flush=True)\n"
                  "sys.exit(143)\n")


@pytest.mark.parametrize("saves,closing", [
    # Before: "worker 0 was preempted (exit 143, checkpoint saved)" though
    # no worker saved one (mutation tried: the report ignored -> fails).
    # (Both exit 143 at once: either is seen first.)
    (False, r"\[launcher\] exit 143: worker [01] exited 143 but no worker "
            r"reported a checkpoint: nothing new was saved"),
    (True, r"\[launcher\] exit 143: preempted: ckpt-5 complete on disk \("),
], ids=["nothing reported", "reported"])
def test_workers_preempted_by_their_scheduler_are_said_as_they_reported(
        tmp_path, saves, closing):
    code, output = launch(["--num_workers", "2", "--", sys.executable, "-c",
                           SELF_PREEMPTED, str(tmp_path),
                           *(["save"] if saves else [])])
    assert code == 143, output
    assert re.match(closing, output.rstrip().splitlines()[-1]), output
    assert "checkpoint saved)" not in output


HANGS = ("import os, sys, time\n"
         "from tfscale.cluster.heartbeat import from_environment\n"
         "beat = from_environment()\n"
         "index = int(os.environ['TFSCALE_WORKER_INDEX'])\n"
         "for step in range(10):\n"
         "    beat.beat('call', step)\n"
         "    time.sleep(0.05)\n"
         "    beat.beat('step', step + 1)\n"
         "if index == 1:\n"
         "    time.sleep(600)  # stuck on the host: a callback, its input\n"
         "beat.beat('call', 10)\n"
         "time.sleep(600)  # waits in the all-reduce for worker 1\n")


def test_a_hung_worker_is_named_not_the_peer_that_waits_for_it(tmp_path):
    # Before: nothing noticed a live hang until the collective timeout
    # (300 s), and then the waiting, healthy worker was named. Worker 0
    # is silent too (inside its next call), but further on.
    start = time.monotonic()
    code, output = launch(["--num_workers", "2", "--hang_floor_seconds", "4",
                           "--failure_grace_seconds", "1", "--",
                           sys.executable, "-c", HANGS, str(tmp_path)],
                          timeout=120)
    assert code == 124, output
    assert time.monotonic() - start < 60
    assert re.search(r"\[launcher\] worker 1 hung: no next step call for "
                     r"\d+ s, past the floor of 4 s \(this phase took at "
                     r"most 0\.\d s before\)", output), output
    assert "last seen between step calls after step 10;" in output
    assert output.rstrip().splitlines()[-1].startswith(
        "[launcher] exit 124: worker 1 hung (no next step call"), output
    assert processes_mentioning(str(tmp_path)) == []


def test_the_hang_limits_follow_the_run_between_floor_and_ceiling():
    from launch import hangs
    limits = hangs.HangLimits(floor_seconds=60, ceiling_seconds=1800,
                              factor=10)
    assert limits.timeout(None) == 1800  # a phase never seen
    assert limits.timeout(0.5) == 60  # the floor
    assert limits.timeout(9.4) == 94
    assert limits.timeout(600) == 1800


STOPS = ("import os, signal, sys, time\n"
         "index = int(os.environ['TFSCALE_WORKER_INDEX'])\n"
         "print('ready', flush=True)\n"
         "if index == 1:\n"
         "    os.kill(os.getpid(), signal.SIGSTOP)\n"
         "time.sleep(1)\n"
         "print('tfscale: worker 0 failed: UnavailableError: The following "
         "tasks are unhealthy (stopped sending heartbeats) (lost peer: "
         "worker 1); ending the job', flush=True)\n"
         "sys.exit(1)\n")


PARTITION = ("import os, sys, time\n"
             "index = int(os.environ['TFSCALE_WORKER_INDEX'])\n"
             "time.sleep(0.5 + 0.2 * index)\n"
             "print(f'tfscale: worker {index} failed: UnavailableError: The "
             "following tasks are unhealthy (stopped sending heartbeats) "
             "(lost peer: worker {1 - index}); ending the job', flush=True)\n"
             "sys.exit(1)\n")

# Worker 0 loses worker 1, which goes on running and beating.
ONE_SIDED = ("import os, sys, time\n"
             "index = int(os.environ['TFSCALE_WORKER_INDEX'])\n"
             "if index == 0:\n"
             "    time.sleep(0.5)\n"
             "    print('tfscale: worker 0 failed: UnavailableError: "
             "Deadline Exceeded (lost peer: worker 1); ending the job', "
             "flush=True)\n"
             "    sys.exit(1)\n"
             "time.sleep(60)\n")


@pytest.mark.parametrize("script, seen", [
    (PARTITION, "worker 0 and worker 1 each lost the other"),
    (ONE_SIDED, "worker 1 was still running when worker 0 lost it")])
def test_a_lost_link_is_named_not_a_worker(tmp_path, script, seen):
    # Before: "worker 1 failed (exit code 1)" for a partition, the worker
    # whose exit the launcher saw first.
    code, output = launch(["--num_workers", "2", "--max_restarts", "0",
                           "--failure_grace_seconds", "1", "--",
                           sys.executable, "-c", script, str(tmp_path)],
                          timeout=60)
    assert code == 1, output
    assert (f"{seen}: the network between worker 0 and worker 1 failed, "
            "not a worker") in output, output
    assert output.rstrip().splitlines()[-1] == (
        "[launcher] exit 1: the network between worker 0 and worker 1 "
        f"failed ({seen})"), output
    assert processes_mentioning(str(tmp_path)) == []


def test_a_stopped_worker_is_named_not_the_peer_that_noticed(tmp_path):
    # Before: "worker 0 failed (exit code 1)" for a SIGSTOP of worker 1.
    code, output = launch(["--num_workers", "2", "--failure_grace_seconds",
                           "1", "--", sys.executable, "-c", STOPS,
                           str(tmp_path)], timeout=60)
    assert code == 124, output
    assert ("[launcher] worker 1 hung: stopped by the kernel (SIGSTOP or a "
            "debugger: state T), so its peers lost it; worker 0 said: "
            "tfscale: worker 0 failed:") in output, output
    assert processes_mentioning(str(tmp_path)) == []


def test_a_signal_during_the_wait_before_a_restart_is_the_launchers_last_line(
        tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.local", "--num_workers", "1",
         "--max_restarts", "3", "--restart_backoff_seconds", "60", "--",
         sys.executable, "-c", "raise SystemExit(9)", str(tmp_path)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = ""
    while "restart 1/3" not in line:
        line = proc.stdout.readline()
        assert line, "launcher ended early"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)  # not the 60 s wait
    assert proc.returncode == 143, output
    assert output.rstrip().splitlines()[-1] == (
        "[launcher] exit 143: SIGTERM before the restart: no worker was "
        "running; the latest checkpoint stands")
