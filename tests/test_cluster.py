import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tfscale.cluster.environment import (ClusterConfig, ClusterError,
                                         resolve_cluster)


def tf_config(cluster, task):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}


def test_no_environment_is_single_worker():
    info = resolve_cluster({})
    assert (info.num_workers, info.worker_index, info.is_chief, info.source) == (
        1, 0, True, "single")


def test_tf_config_worker_zero_is_chief():
    env = tf_config({"worker": ["a:1", "b:2", "c:3"]},
                    {"type": "worker", "index": 2})
    info = resolve_cluster(env)
    assert (info.num_workers, info.worker_index, info.is_chief) == (3, 2, False)
    assert info.address == "c:3"
    assert info.peer_addresses == ["a:1", "b:2"]
    assert resolve_cluster(tf_config({"worker": ["a:1", "b:2"]},
                                     {"type": "worker", "index": 0})).is_chief


def test_tf_config_with_chief_counts_chief_first():
    env = tf_config({"chief": ["c:1"], "worker": ["w:1", "w:2"]},
                    {"type": "worker", "index": 0})
    info = resolve_cluster(env)
    assert (info.num_workers, info.worker_index, info.is_chief) == (3, 1, False)
    chief = resolve_cluster(tf_config({"chief": ["c:1"], "worker": ["w:1"]},
                                      {"type": "chief", "index": 0}))
    assert chief.is_chief and chief.worker_index == 0


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "no 'cluster'"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "no 'task'"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}),
     "has no 'type'"),
    (json.dumps({"cluster": {"worker": ["a:1"]},
                 "task": {"type": "ps", "index": 0}}), "'ps' is not in"),
    (json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                 "task": {"type": "worker", "index": 2}}), "out of range"),
    (json.dumps({"cluster": {"worker": ["a1"]},
                 "task": {"type": "worker", "index": 0}}), "host:port"),
    (json.dumps({"cluster": {"ps": ["a:1"], "worker": ["b:2"]},
                 "task": {"type": "worker", "index": 0}}), "task types ['ps']"),
])
def test_bad_tf_config_names_the_problem(text, message):
    with pytest.raises(ClusterError, match="TF_CONFIG") as error:
        resolve_cluster({"TF_CONFIG": text})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_slurm_two_tasks_on_one_node():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2"}
    info = resolve_cluster(env, slurm_port_base=7000)
    assert info.source == "slurm"
    assert info.cluster == {"worker": ["localhost:7000", "localhost:7001"]}
    assert (info.worker_index, info.is_chief) == (1, False)


def test_slurm_many_nodes_block_distribution():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5",
           "SLURM_JOB_NODELIST": "gpu[01-02],cpu7",
           "SLURM_TASKS_PER_NODE": "2(x2),1"}
    info = resolve_cluster(env, slurm_port_base=9000)
    assert info.cluster["worker"] == ["gpu01:9000", "gpu01:9001", "gpu02:9000",
                                      "gpu02:9001", "cpu7:9000"]
    assert info.address == "gpu02:9001"


def test_slurm_single_task_is_single_worker():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    assert resolve_cluster(env).source == "single"


def test_slurm_inconsistent_tasks_is_an_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    with pytest.raises(ClusterError, match="do not add up"):
        resolve_cluster(env)


def test_tf_config_wins_over_slurm():
    env = tf_config({"worker": ["a:1", "b:2"]}, {"type": "worker", "index": 1})
    env.update({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "n1"})
    assert resolve_cluster(env).source == "tf_config"


def test_cluster_config_validates():
    with pytest.raises(ValueError, match="all_reduce_alg"):
        ClusterConfig(all_reduce_alg="mpi")
    with pytest.raises(ValueError, match="bytes_per_pack"):
        ClusterConfig(bytes_per_pack=-1)


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_started_by_mpirun_without_mpi_backend_is_an_error(variable):
    with pytest.raises(ClusterError, match=rf"one of 4 MPI processes "
                       rf"\({variable}\) without --backend=mpi"):
        resolve_cluster({variable: "4"})
    assert resolve_cluster({variable: "1"}).num_workers == 1


@pytest.mark.parametrize("env, rank, size", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, 2, 4),
    ({"PMI_RANK": "1", "PMI_SIZE": "3"}, 1, 3),
    # srun --mpi=pmix: PMIx gives the rank, SLURM the size.
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
      "SLURM_STEP_NODELIST": "n1"}, 1, 2),
    ({}, 0, 1),
])
def test_mpi_backend_takes_ranks_from_the_mpi_launcher(env, rank, size):
    info = resolve_cluster(env, backend="mpi")
    assert (info.source, info.worker_index, info.num_workers) == (
        "mpi", rank, size)
    assert info.is_chief == (rank == 0)


@pytest.mark.parametrize("env, message", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"},
     r"srun --mpi=pmix"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, '
                   '"task": {"type": "worker", "index": 0}}'},
     r"TF_CONFIG is set but --backend=mpi"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
     r"OMPI_COMM_WORLD_RANK=4 is out of range"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, r"PMI_RANK is not an integer"),
])
def test_mpi_backend_rejects_environments_it_cannot_use(env, message):
    with pytest.raises(ClusterError, match=message):
        resolve_cluster(env, backend="mpi")


def test_backend_is_validated():
    with pytest.raises(ValueError, match="backend must be one of"):
        ClusterConfig(backend="horovod")


def test_the_start_up_watchdog_ends_a_worker_holding_the_gil_with_its_own_code():
    # TensorFlow waiting for peers holds the GIL, as this C sleep does:
    # no Python handler runs. The watchdog's signal still ends the process
    # with STARTUP_TIMEOUT_EXIT_CODE (not 137, an out-of-memory kill to a
    # scheduler); without `exit_on_signal` it would die of the signal.
    from tfscale.cluster import contract, watchdog
    code = contract.STARTUP_TIMEOUT_EXIT_CODE
    script = (
        "import ctypes, os, subprocess, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from tfscale.cluster import watchdog\n"
        f"assert watchdog.exit_on_signal({code})\n"
        "w = subprocess.Popen([sys.executable, watchdog.__file__, "
        f"str(os.getpid()), '1.5', '{code}', 'worker 0', '127.0.0.1:1'], "
        "stdin=subprocess.PIPE)\n"
        "ctypes.PyDLL(None).sleep(60)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == code, done.stderr[-2000:]
    assert time.monotonic() - start < 30
    assert ("tfscale: worker 0 could not start the cluster within 1.5s "
            f"(unreachable peer(s): 127.0.0.1:1); exit {code}") in done.stderr
    assert watchdog.exit_on_signal  # (the module imports without TF)


def test_the_start_up_watchdog_says_which_peers_it_waits_for(monkeypatch,
                                                             capsys):
    from tfscale.cluster import watchdog
    monkeypatch.setattr(watchdog, "REPORT_SECONDS", 0.2)
    read, write = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(read))
    try:
        assert not watchdog._wait(1.0, "worker 0", ["127.0.0.1:1"])
    finally:
        os.close(write)
    said = capsys.readouterr().err
    assert ("tfscale: worker 0 still waiting for the cluster after 0 s "
            "(unreachable peer(s): 127.0.0.1:1); giving up at 1 s") in said
