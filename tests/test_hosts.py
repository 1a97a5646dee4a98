"""More than one host, for real: network namespaces node1 and node2 with
their own addresses, hostnames and sshd (`tests/hosts/local_hosts.sh`),
which Open MPI, ssh and gRPC see as separate nodes.

  - MPI (tfscale-run -np 4 -H node1:2,node2:2): ranks start on both hosts,
    two on each; the flagship on one rank a host (`--backend=mpi`: Google's
    command line, its global batch) gets SIGTERM through the launcher,
    every rank on every host saves the agreed checkpoint and the job exits
    143; the rerun resumes there; a rank killed with -9 on node2 is named.
  - Elastic (tfscale-run --min-np 2 --max-np 3 --host-discovery-script):
    node3's rank killed and its sshd stopped mid-run, the job goes on on
    2 workers; node3 back, the job moves to 3 at the next step; the
    end equals an uninterrupted 3-worker run at the same global batch.
  - MultiWorkerMirroredStrategy from a TF_CONFIG naming node1 and node2 (as
    Kubernetes gives it): SIGTERM to the worker on node2 makes both save at
    one step and exit 143; restarted, they resume and finish.

Skipped where the hosts cannot be made (not root, no network namespaces).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_command
from tests.test_launch import processes_mentioning
from tests.test_pretraining import pretrain_args

pytestmark = pytest.mark.slow
TOOL = os.path.join(REPO, "tests", "hosts", "local_hosts.sh")


@pytest.fixture(scope="module")
def hosts():
    if not os.path.exists(TOOL) or os.geteuid() != 0:
        pytest.skip("needs root (tests/hosts/local_hosts.sh)")
    code, output = run_command(
        ["bash", "-c", f"source {TOOL} && local_hosts 3"], timeout=300)
    if code != 0:
        pytest.skip(f"local_hosts could not make node1-3: {output[-500:]}")
    return ["node1", "node2"]  # (and node3: the elastic test's)


def start(command, env=None, log=None):
    return subprocess.Popen(
        command, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, **(env or {})),
        stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True)


def wait_for(path, pattern, timeout=240):
    """The first match of `pattern` in the file at `path` (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = open(path, errors="replace").read() if os.path.exists(
            path) else ""
        found = re.search(pattern, text)
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not seen in {path}:\n{text[-3000:]}")


def pids_on(host, marker):
    """PIDs of processes in `host`'s namespace whose command has `marker`."""
    inside = subprocess.run(["ip", "netns", "pids", host], text=True,
                            stdout=subprocess.PIPE).stdout.split()
    return sorted(set(processes_mentioning(marker)) & set(map(int, inside)))


def tfscale_run(hosts_arg, np, *command):
    return [sys.executable, "-m", "launch.horovodrun", "-np", str(np), "-H",
            hosts_arg, *command]


def test_mpi_ranks_on_two_hosts_preempt_resume_and_a_dead_rank_is_named(
        hosts, corpus, tmp_path):  # noqa: F811
    code, output = run_command(tfscale_run(
        "node1:2,node2:2", 4, sys.executable, "-c",
        "import socket; print('host', socket.gethostname())"), timeout=120)
    assert code == 0, output[-3000:]
    assert sorted(re.findall(r"\] host (node\d)", output)) == [
        "node1", "node1", "node2", "node2"], output[-2000:]
    # (Horovod's own examples run on 2 ranks in test_horovod_ranks.py.)

    out = tmp_path / "run"
    # The flagship one rank a host (two a host: the placement above).
    flagship = tfscale_run(
        "node1:1,node2:1", 2, sys.executable, "run_pretraining.py",
        *pretrain_args(corpus, out, 400, "--backend=mpi", "--deterministic",
                       "--save_checkpoints_steps=1000"))
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        proc = start(flagship, log=f)
        wait_for(log, r"tfscale: step 10:")
        proc.send_signal(signal.SIGTERM)  # to tfscale-run, as a scheduler
        proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 143, text[-5000:]
    step = int(re.search(r"\[worker 0\] run_pretraining: preempted: "
                         r"checkpoint at step (\d+) saved", text).group(1))
    assert f"[worker 1] run_pretraining: preempted: checkpoint at " \
           f"step {step} saved" in text, text[-5000:]  # rank 1: on node2
    assert (out / "checkpoints" / f"ckpt-{step}.index").exists()

    log = tmp_path / "second.log"
    with open(log, "w") as f:
        proc = start(flagship, log=f)
        wait_for(log, rf"resumed from \S+ckpt-{step} at step {step}; input "
                      r"position restored")
        wait_for(log, rf"tfscale: step {(step // 5 + 2) * 5}:")
        victims = pids_on("node2", "run_pretraining.py")
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode != 0
    # mpirun reports the rank that died, or (a race between its daemons and
    # the ranks' own connections) a rank that lost it and aborted first:
    # then the launcher says so, with the peer's host when Open MPI gives it.
    assert (re.search(r"\[launcher\] worker 1 failed \(killed by "
                      r"SIGKILL\); stopping the other workers", text)
            or re.search(r"\[launcher\] worker \d failed \(exit code \d+\)"
                         r": it lost its MPI peer on node2 \(a rank there "
                         r"died or was killed first\)", text)
            or re.search(r"\[launcher\] worker 0 failed \(exit code \d+\)"
                         r": it lost an MPI connection \(another rank died "
                         r"or was killed first", text)), text[-5000:]


def test_tf_config_naming_two_hosts_preempts_together_and_resumes(
        hosts, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    cluster = {"worker": ["node1:23456", "node2:23456"]}
    args = pretrain_args(corpus, out, 40, "--deterministic",
                         "--save_checkpoints_steps=1000", "--log_steps=2")

    def start_both(tag):
        procs, logs = [], []
        for index, host in enumerate(hosts):
            env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {
                "type": "worker", "index": index}})}
            path = tmp_path / f"{tag}-{index}.log"
            logs.append(path)
            with open(path, "w") as f:
                procs.append(start(["ip", "netns", "exec", host,
                                    sys.executable, "run_pretraining.py",
                                    *args], env=env, log=f))
        return procs, logs

    procs, logs = start_both("first")
    wait_for(logs[0], r"tfscale: step 6:")
    (victim,) = pids_on("node2", "run_pretraining.py")
    os.kill(victim, signal.SIGTERM)  # as the kubelet does
    for p in procs:
        p.wait(timeout=120)
    texts = [path.read_text() for path in logs]
    assert [p.returncode for p in procs] == [143, 143], texts[0][-4000:]
    step = int(re.search(r"preempted: checkpoint at step (\d+) saved",
                         texts[0]).group(1))
    assert f"preempted: checkpoint at step {step} saved" in texts[1]
    assert "workers 2 (tf_config)" in texts[0]

    procs, logs = start_both("second")
    for p in procs:
        p.wait(timeout=240)
    texts = [path.read_text() for path in logs]
    assert [p.returncode for p in procs] == [0, 0], texts[0][-4000:]
    assert re.search(rf"resumed from \S+ckpt-{step} at step {step}; input "
                     r"position restored", texts[0]), texts[0][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["num_workers"] == 2


def test_the_link_probe_recovers_a_shaped_links_latency_and_bandwidth(
        hosts, tmp_path):
    """`python -m tfscale.cluster.link_probe` on node1 and node2 (workers of
    a TF_CONFIG naming both: the gRPC ring), each host's link shaped by `tc` on
    each end of its veth pair: 160 Mbit/s, and 2 ms of delay where the
    kernel has netem (else a token bucket, rate only). tfscale-plan --link
    fits the sweep to the ring's bus bandwidth (the rate) and latency (a
    2-rank all-reduce: 2 one-way trips of 2 x 2 ms): each within 25%."""
    rules = ["netem delay 2ms rate 160mbit limit 10000",
             "tbf rate 160mbit burst 256kb latency 400ms"]
    shaped, delayed = [], None
    try:
        for i in (1, 2):
            for end in (f"dev vh{i}", f"dev vn{i}"):
                inside = f"ip netns exec node{i} " if "vn" in end else ""
                for rule in rules if delayed is None else [
                        rules[0] if delayed else rules[1]]:
                    code, output = run_command(
                        ["bash", "-c",
                         f"{inside}tc qdisc replace {end} root {rule}"])
                    if code == 0:
                        delayed = rule.startswith("netem")
                        break
                else:
                    pytest.skip(f"tc cannot shape the links: {output[-300:]}")
                shaped.append(f"{inside}tc qdisc del {end} root")
        sweep = tmp_path / "link.json"
        cluster = {"worker": ["node1:23457", "node2:23457"]}
        procs = []
        for index, host in enumerate(hosts):
            env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {
                "type": "worker", "index": index}})}
            procs.append(start(["ip", "netns", "exec", host, sys.executable,
                                "-m", "tfscale.cluster.link_probe",
                                "--output", str(sweep), "--sizes",
                                "262144,1048576,4194304,8388608",
                                "--repeats", "5"], env=env))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:]
    finally:
        for command in shaped:
            run_command(["bash", "-c", command])
    from planning import cli
    latency, bandwidth, ranks = cli._link(str(sweep))
    assert ranks == 2
    assert bandwidth == pytest.approx(160e6 / 8, rel=0.25), bandwidth
    if delayed:
        assert latency == pytest.approx(4 * 2e-3, rel=0.25), latency
    else:  # no delay to find: the transport's own, below the 25% band
        # around the 8 ms a shaped link shows (6-10 ms)
        assert 0 <= latency < 6e-3, latency


def sshd(host, up):
    """Starts (local_hosts is idempotent) or stops `host`'s sshd."""
    command = (f"source {TOOL} && local_hosts 3" if up else
               f"kill $(cat /run/sshd-{host}.pid)")
    code, output = run_command(["bash", "-c", command], timeout=120)
    assert code == 0, output


def test_an_elastic_run_loses_a_host_and_takes_it_back_and_ends_as_one_run(
        hosts, corpus, tmp_path):  # noqa: F811
    from tests.test_global_order import assert_same_run, state
    config = json.loads((corpus / "bert_config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (corpus / "no_dropout.json").write_text(json.dumps(config))
    # Enough steps that 2 workers are still training when node3 is back.
    steps = 150

    def job(out, save=10):
        # 24 records a step in micro-batches of 4: 2 accumulation steps on
        # 3 ranks, 3 on 2, the same micro-batches either way.
        return [sys.executable, "run_pretraining.py", *pretrain_args(
            corpus, out, steps, f"--bert_config_file={corpus}/no_dropout.json",
            "--train_batch_size=24", "--micro_batch_size=4", "--backend=mpi",
            "--deterministic", "--seed=11", f"--save_checkpoints_steps={save}")]

    reference = tmp_path / "reference"
    code, output = run_command(tfscale_run(
        "node1:1,node2:1,node3:1", 3, *job(reference, save=steps)),
        timeout=600)
    assert code == 0, output[-5000:]
    assert "global batch 24 = 4 per replica x 3 x 2 accumulation" in output

    listing = tmp_path / "hosts.txt"
    listing.write_text("node1\nnode2\nnode3\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {listing}\n")
    discover.chmod(0o755)
    out = tmp_path / "elastic"
    log = tmp_path / "elastic.log"
    command = [sys.executable, "-m", "launch.horovodrun", "--min-np", "2",
               "--max-np", "3", "--host-discovery-script", str(discover),
               "--discovery-interval", "0.5", "--max-restarts", "2",
               *job(out)]
    with open(log, "w") as f:
        proc = start(command, log=f)
        try:
            wait_for(log, r"tfscale: step 15:")
            (victim,) = pids_on("node3", "run_pretraining.py")
            os.kill(victim, signal.SIGKILL)  # node3 lost: its rank, sshd
            listing.write_text("node1\nnode2\n")
            sshd("node3", up=False)
            wait_for(log, r"elastic: 2 workers on node1:1,node2:1 ")
            wait_for(log, r"global batch 24 = 4 per replica x 2 x 3 "
                          r"accumulation")
            resumed = wait_for(log, r"resumed from \S+ckpt-(\d+) at step")
            # Trained on 2 workers (a line after the resume's).
            wait_for(log, re.escape(resumed.group(0)) + r"[\s\S]*"
                     rf"tfscale: step {int(resumed.group(1)) + 5}:")
            sshd("node3", up=True)  # back
            listing.write_text("node1\nnode2\nnode3\n")
            wait_for(log, r"elastic: 3 workers on node1:1,node2:1,node3:1 ")
            proc.wait(timeout=600)
        finally:
            proc.kill()
            sshd("node3", up=True)
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    # Whichever the launcher saw first, the rank's death (then its host is
    # charged when MPI names it) or the listing, node3 is named.
    assert "[launcher] elastic: 2 workers on node1:1,node2:1 (node3 gone " \
        "from the discovery output): from the last whole checkpoint" in text
    assert "node1 has failed" not in text and "node2 has failed" not in text
    assert "[launcher] elastic: 3 workers on node1:1,node2:1,node3:1 (node3 " \
        "joined): from the last whole checkpoint" in text
    assert re.search(r"\[launcher\] elastic: node3 joined the discovery "
                     r"output: every worker saves at its next step", text)
    moved = int(re.search(r"\[launcher\] elastic: ckpt-(\d+) complete on "
                          r"disk", text).group(1))
    assert re.search(rf"resumed from \S+ckpt-{moved} at step {moved}", text)
    assert text.rstrip().endswith("[launcher] exit 0: every worker finished")
    assert_same_run(state(reference, steps), state(out, steps),
                    "3 -> 2 -> 3 workers")
