"""tfscale.horovod in one process (size 1, no launcher, as under Horovod)
and tfscale-run's command line. Real ranks: tests/test_horovod_ranks.py."""

import argparse
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfscale.horovod as hvd
import tfscale.horovod.keras as hvdk
from launch import horovodrun as run_lib
from tfscale.horovod import _state, protocol

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh():
    hvd.shutdown()
    yield
    hvd.shutdown()


def test_every_call_before_init_gives_horovods_error(fresh):
    for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.cross_size,
                 lambda: hvd.allreduce(tf.ones([2])),
                 lambda: hvd.allgather(tf.ones([2])),
                 lambda: hvd.broadcast(tf.ones([2]), 0),
                 lambda: hvd.broadcast_object(1),
                 lambda: hvd.DistributedGradientTape(tf.GradientTape()),
                 lambda: hvd.DistributedOptimizer(
                     tf.keras.optimizers.SGD(0.1))):
        with pytest.raises(ValueError, match=r"^Horovod has not been "
                           r"initialized; use hvd.init\(\).$"):
            call()
    assert not hvd.is_initialized()


def test_without_a_launcher_a_script_is_size_one(fresh):
    hvd.init()
    hvd.init()  # again: no effect
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(),
            hvd.cross_size(), hvd.cross_rank()) == (1, 0, 1, 0, 1, 0)
    assert hvd.is_initialized() and not hvd.mpi_enabled()
    x = tf.constant([[1.0, 2.0]])
    np.testing.assert_array_equal(hvd.allreduce(x), x)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum,
                                                prescale_factor=3.0), 3 * x)
    np.testing.assert_array_equal(hvd.allgather(x), x)
    np.testing.assert_array_equal(hvd.broadcast(x, 0), x)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object(5) == [5]
    assert hvd.join() == 0
    with pytest.raises(ValueError, match="root_rank=1 is out of range"):
        hvd.broadcast(x, 1)


def test_the_tape_and_optimizer_change_nothing_on_one_rank(fresh):
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((3,)),
                                 tf.keras.layers.Dense(2)])
    x = tf.random.normal([4, 3])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    plain = tape.gradient(loss, model.trainable_variables)
    wrapped = hvd.DistributedGradientTape(tape).gradient(
        loss, model.trainable_variables)
    for a, b in zip(plain, wrapped):
        np.testing.assert_allclose(a, b)
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    assert type(optimizer).__name__ == "SGD"
    assert isinstance(optimizer, tf.keras.optimizers.SGD)
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(optimizer)
    with pytest.raises(TypeError, match="wraps Keras 3, tf_keras"):
        hvd.DistributedOptimizer(object())


def test_what_is_not_offered_says_what_to_use(fresh):
    hvd.init()
    cases = [
        (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum), "no Adasum"),
        (lambda: hvd.elastic.run, "--max-restarts"),
        (lambda: hvd.elastic.TensorFlowKerasState(None), "--max-restarts"),
        (hvd.start_timeline, "TensorBoard"),
        (lambda: hvd.alltoall(tf.ones([2])), "allgather"),
        (lambda: hvd.ProcessSet([0]), "no process sets"),
        (lambda: hvd.init(process_sets=[[0]]), "no process sets"),
        (lambda: hvd.allreduce(tf.ones([2]), process_set=object()),
         "global_process_set"),
        (lambda: hvd.broadcast_global_variables(0), "broadcast_variables"),
        (lambda: hvdk.broadcast_global_variables(0),
         "BroadcastGlobalVariablesCallback"),
    ]
    for call, hint in cases:
        with pytest.raises(NotImplementedError, match=hint):
            value = call()
            if callable(value):
                value()
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(tf.ones([2]), average=True, op=hvd.Sum)


def test_fp16_compression_sends_half_and_returns_the_dtype():
    x = tf.constant([0.1, 1000.5], tf.float32)
    sent, context = hvd.Compression.fp16.compress(x)
    assert sent.dtype == tf.float16
    back = hvd.Compression.fp16.decompress(sent, context)
    assert back.dtype == tf.float32
    np.testing.assert_allclose(back, x, rtol=1e-3)
    ints = tf.constant([1, 2])
    assert hvd.Compression.fp16.compress(ints)[0].dtype == tf.int32
    assert hvd.Compression.none.compress(x)[0] is x


def test_keras3_optimizer_variables_are_callable_like_keras2_after_init():
    # In a fresh process: importing changes nothing, init() does.
    script = (
        "import keras, tensorflow as tf\n"
        "import tfscale.horovod as hvd\n"
        "opt = keras.optimizers.Adam()\n"
        "opt.build([tf.Variable(tf.zeros([2]))])\n"
        "print('imported', callable(opt.variables))\n"
        "hvd.init()\n"
        "print('init', callable(opt.variables), "
        "opt.variables() == opt.variables, type(opt.variables).__mro__[1])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported False" in done.stdout
    assert "init True True <class 'list'>" in done.stdout


# ---- tfscale-run's command line ---------------------------------------------

def args_of(argv):
    return run_lib.parse_args(argv)


def test_hosts_and_hostfiles_parse_like_horovodrun(tmp_path):
    assert run_lib.parse_hosts("server1:4,server2:4,server3") == [
        ("server1", 4), ("server2", 4), ("server3", 1)]
    with pytest.raises(run_lib.UsageError, match="'a:x' is not host:slots"):
        run_lib.parse_hosts("a:x")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2 slots=2  # gpu\n"
                        "node3\n")
    assert run_lib.parse_hostfile(str(hostfile)) == [
        ("node1", 4), ("node2", 2), ("node3", 1)]
    with pytest.raises(run_lib.UsageError, match="No such file"):
        run_lib.parse_hostfile(str(tmp_path / "missing"))
    args = args_of(["-np", "16", "-H", "a:4,b:4", "python", "t.py"])
    with pytest.raises(run_lib.UsageError,
                       match="-np 16 needs 16 slots; -H a:4,b:4 has 8"):
        run_lib.resolve_hosts(args)
    assert run_lib.resolve_hosts(args_of(["-np", "3", "python", "t.py"])) == [
        ("localhost", 3)]
    assert run_lib.is_local([("localhost", 2)])
    assert not run_lib.is_local([("server1", 4)])


def test_the_multi_host_mpirun_command_line():
    args = args_of(["-np", "16", "-H", "server1:4,server2:4,server3:4,"
                    "server4:4", "-p", "2222", "--network-interface",
                    "eth0,eth1", "--mpi-args", "--mca btl_tcp_eager_limit "
                    "65536", "python", "train.py", "--lr", "0.1"])
    assert args.command == ["python", "train.py", "--lr", "0.1"]
    hosts = run_lib.resolve_hosts(args)
    extra = run_lib.mpirun_args(args, hosts, ["PATH", "TF_CPP_MIN_LOG_LEVEL"],
                                major=5)
    assert extra == [
        "-H", "server1:4,server2:4,server3:4,server4:4",
        "--map-by", "slot", "--bind-to", "none",
        "--prtemca", "plm_ssh_args", "-p 2222",
        "--mca", "btl_tcp_if_include", "eth0,eth1",
        "-x", "NCCL_SOCKET_IFNAME=eth0,eth1",
        "--prtemca", "oob_tcp_if_include", "eth0,eth1",
        "-x", "PATH", "-x", "TF_CPP_MIN_LOG_LEVEL",
        "--mca", "btl_tcp_eager_limit", "65536"]
    old = run_lib.mpirun_args(args, hosts, [], major=4)
    assert ["--mca", "plm_rsh_args", "-p 2222"] == old[6:9]
    from launch import mpi_ranks
    command = mpi_ranks.mpirun_command(args.command, 16, "mpirun",
                                   extra_args=extra)
    assert command[:4] == ["mpirun", "-np", "16", "--output"]
    assert "--oversubscribe" not in command  # --map-by slot given
    assert command[-4:] == ["python", "train.py", "--lr", "0.1"]


def test_remote_ranks_get_the_environment_but_not_the_launchers_session():
    names = run_lib.forwarded({"PATH": "/bin", "PYTHONPATH": "/x",
                               "TF_CPP_MIN_LOG_LEVEL": "1", "SSH_AUTH_SOCK": "s",
                               "OMPI_COMM_WORLD_RANK": "0", "PWD": "/",
                               "BASH_FUNC_x%%": "() {\n}", "HOROVOD_X": "1"})
    assert sorted(names) == ["HOROVOD_X", "PATH", "PYTHONPATH",
                             "TF_CPP_MIN_LOG_LEVEL"]


def test_horovodrun_options_not_offered_fail_naming_the_alternative(capsys):
    for argv, hint in [(["--gloo"], "runs MPI only"),
                       (["--blacklist-cooldown-range", "1", "2"],
                        "--host-failures"),
                       (["--timeline-filename", "t.json"], "TensorBoard"),
                       (["--fusion-threshold-mb", "64"], "one all-reduce")]:
        with pytest.raises(SystemExit) as exit_info:
            args_of(["-np", "2", *argv, "python", "t.py"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"{argv[0]} is not offered" in err and hint in err
    # The script's own flags after the command are the script's.
    args = args_of(["-np", "2", "python", "t.py", "--gloo"])
    assert args.command == ["python", "t.py", "--gloo"]
    assert args_of(["-np", "2", "--disable-cache", "--mpi", "python",
                    "t.py"]).command == ["python", "t.py"]
    with pytest.raises(SystemExit):
        args_of(["python", "t.py"])  # no -np
    assert isinstance(args_of(["--check-build"]), argparse.Namespace)
    assert "[X] MPI" in run_lib.check_build()


def test_open_mpi_version_is_read_from_the_mpirun_given(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    with pytest.raises(run_lib.UsageError, match="not Open MPI's mpirun"):
        run_lib.open_mpi_major(str(fake))
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.6'\n")
    assert run_lib.open_mpi_major(str(fake)) == 4


def test_state_is_one_per_process(fresh):
    hvd.init()
    first = _state.get()
    hvd.init()  # again: no effect
    assert _state.get() is first
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()  # after shutdown: a new state
    assert _state.get() is not first


def test_load_model_wraps_the_saved_optimizer(fresh, tmp_path):
    hvd.init()
    model = tf.keras.Sequential([tf.keras.Input((3,)),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = hvdk.load_model(path)
    assert "_hvd" in loaded.optimizer.__dict__  # a DistributedOptimizer
    assert type(loaded.optimizer).__name__ == "Adam"
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    loaded.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)  # still trains


def test_mpi_output_buffers_are_host_tensors_filled_in_place():
    """What MPI writes into is made on the host whatever the caller's
    device scope (on a GPU host a device tensor's NumPy view is a copy:
    filling it would return garbage), and the view is the tensor's own
    buffer (no copy on a CPU host)."""
    from tfscale import _compat
    with tf.device("/cpu:1"):
        tensor, view = _compat.new_host_tensor([2, 3], tf.float32)
    assert tensor.device.endswith("CPU:0"), tensor.device
    view[...] = 7.0
    assert tensor.numpy().tolist() == [[7.0] * 3] * 2


def test_first_calls_mode_checks_each_name_three_times_then_trusts_it(fresh):
    from tfscale.horovod import ops
    state = _state.State(rank=0, size=2, local_rank=0, local_size=2,
                         cross_rank=0, cross_size=1, homogeneous=True,
                         check="first")
    decisions = [protocol.trusted(state, protocol.ALLREDUCE, "grads")
                 for _ in range(5)]
    assert decisions == [False] * protocol.FIRST_CHECKS + [True] * 2
    assert not protocol.trusted(state, protocol.ALLREDUCE, "other")  # its own count
    assert not any(protocol.trusted(state, protocol.ALLGATHER, "sizes")
                   for _ in range(5))  # allgather needs every rank's size
    assert state.sequence == 2  # trusted calls still count
    every = _state.State(rank=0, size=2, local_rank=0, local_size=2,
                         cross_rank=0, cross_size=1, homogeneous=True)
    assert not any(protocol.trusted(every, protocol.ALLREDUCE, "grads")
                   for _ in range(5))
    _state._state = state
    with pytest.raises(NotImplementedError, match="join\\(\\) needs every "
                       "collective checked"):
        hvd.join()
