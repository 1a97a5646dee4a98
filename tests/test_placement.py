"""Where a worker's replicas and variables go (`tfscale/cluster/placement.py`).

TensorFlow decides where a MultiWorkerMirroredStrategy puts a worker's
replicas from its cluster resolver's `num_accelerators()`; a resolver built
without it gave every GPU worker 0 GPUs and its variables the CPU, which no
CPU test could see (on a CPU every device count is the same). These tests
feed the inputs TensorFlow decides from: a GPU listing as CUDA would make
it from `CUDA_VISIBLE_DEVICES` (the launchers' per-worker and shared
bindings), the resolver built from it, TensorFlow's own rule applied to
that resolver, and the start-up check against replicas and variables put
on the wrong device.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy

from launch import gpus as launch_gpus
from launch import local
from tests.conftest import REPO, run_command
from tfscale.cluster import all_reduce_impl, devices, placement, strategies
from tfscale.cluster.contract import SHARED_GPUS_ENV
from tfscale.cluster.environment import ClusterConfig, resolve_cluster
from tfscale.errors import ConfigError
from tfscale.trainer.loop import TrainConfig, Trainer

HOST_GPUS = 4


@pytest.fixture(autouse=True)
def nccl_present(monkeypatch):
    """NCCL's library as if installed (its lookup is tests/test_gpu_binding.py's)."""
    monkeypatch.setattr(all_reduce_impl, "load_nccl",
                        lambda *a, **k: all_reduce_impl.NcclLibrary(
                            all_reduce_impl.NCCL_LIBRARY, "2.27.7"))


def cuda_listing(monkeypatch, env, host_gpus=HOST_GPUS):
    """TensorFlow's GPU listing as CUDA makes it on a host with `host_gpus`
    GPUs: the entries of `env`'s CUDA_VISIBLE_DEVICES when set ("": none),
    else every GPU, renumbered from 0."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = (list(range(host_gpus)) if visible is None else
           [g for g in visible.split(",") if g.strip() not in ("", "-1")])
    fakes = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
             for i in range(len(ids))]
    listed, configured = (tf.config.get_visible_devices,
                          tf.config.get_logical_device_configuration)
    monkeypatch.setattr(
        tf.config, "get_visible_devices",
        lambda device_type=None: (list(fakes) if device_type == "GPU"
                                  else listed(device_type)))
    monkeypatch.setattr(
        tf.config, "get_logical_device_configuration",
        lambda device: None if device in fakes else configured(device))
    return len(fakes)


def tensorflow_devices(resolver, task=1):
    """The devices TensorFlow 2.21's MWMS puts a worker's replicas on, for
    `resolver` (its own rule, `_initialize_local_devices`)."""
    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    devices, _ = extended._initialize_local_devices(
        None, resolver, f"/job:worker/replica:0/task:{task}")
    return devices


class RecordingMwms:
    """Stands in for MultiWorkerMirroredStrategy in `make_strategy`: keeps
    the resolver, puts the replicas where TensorFlow would for it."""

    made = []

    def __init__(self, cluster_resolver, communication_options):
        RecordingMwms.made.append(cluster_resolver)
        self.cluster_resolver = cluster_resolver
        self.extended = type("Extended", (), {
            "worker_devices": tensorflow_devices(cluster_resolver),
            "_communication_options": communication_options})()

    def run(self, fn):
        return fn()

    def reduce(self, op, value, axis):
        return value


def two_worker_info(index=1, env=()):
    """Worker `index` of two on 127.0.0.1, its environment `env` besides
    TF_CONFIG (CUDA_VISIBLE_DEVICES, the launcher's sharing)."""
    with local.ports.lease(2, "127.0.0.1") as held:
        addresses = [f"127.0.0.1:{p}" for p in held.ports]
    return resolve_cluster({**dict(env), "TF_CONFIG": json.dumps({
        "cluster": {"worker": addresses},
        "task": {"type": "worker", "index": index}})})


@pytest.mark.parametrize("visible,expected", [
    (None, {"GPU": HOST_GPUS}), ("0", {"GPU": 1}), ("1,3", {"GPU": 2}),
    ("", {})])
def test_make_strategy_gives_mwms_the_gpus_the_worker_sees(
        monkeypatch, visible, expected):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    cuda_listing(monkeypatch, env)
    RecordingMwms.made.clear()
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                        RecordingMwms)
    # (No real cluster: the coordination service is the fake's business.)
    monkeypatch.setattr(strategies, "start_coordination", lambda *a: None)
    strategy = strategies.make_strategy(two_worker_info(env=env), ClusterConfig())
    (resolver,) = RecordingMwms.made
    assert resolver.num_accelerators() == expected
    count = expected.get("GPU", 0)
    assert strategy.extended.worker_devices == (
        tuple(f"/job:worker/replica:0/task:1/device:GPU:{i}"
              for i in range(count))
        or ("/job:worker/replica:0/task:1/device:CPU:0",))


def test_a_strategy_built_after_the_runtime_started_is_refused_in_one_line():
    # This process made tensors already: MultiWorkerMirroredStrategy would
    # fail with "Collective ops must be configured at program startup".
    tf.constant(1.0)
    from tfscale.errors import ConfigError
    with pytest.raises(ConfigError) as refused:
        strategies.start_coordination(two_worker_info(), ClusterConfig(),
                                      "worker 1")
    assert str(refused.value) == f"worker 1: {strategies.STARTUP_ORDER}"
    assert strategies.is_startup_order_error(RuntimeError(
        "Collective ops must be configured at program startup"))


@pytest.mark.parametrize("launcher,host_env,expected", [
    # launch.local's default on a 4-GPU host: one GPU each.
    (dict(gpus_per_worker=None), {}, [1, 1]),
    # --gpus_per_worker 2: GPUs 0,1 and 2,3.
    (dict(gpus_per_worker=2), {}, [2, 2]),
    # --gpus_per_worker 0: CPU workers on a GPU host.
    (dict(gpus_per_worker=0), {}, [0, 0]),
    # A scheduler's binding (SLURM, Kubernetes): picked from it.
    (dict(gpus_per_worker=None), {"CUDA_VISIBLE_DEVICES": "4,6"}, [1, 1]),
    # --share_gpus: every worker sees every GPU of the host (a 1-GPU one).
    (dict(share=True), {"CUDA_VISIBLE_DEVICES": "0"}, [1, 1]),
])
def test_each_workers_resolver_counts_the_gpus_its_binding_leaves_it(
        monkeypatch, launcher, host_env, expected):
    """The launcher's CUDA_VISIBLE_DEVICES per worker, through CUDA's
    listing, to the resolver TensorFlow reads and the devices it picks."""
    host = host_env.get("CUDA_VISIBLE_DEVICES")
    host_gpus = (launch_gpus.host_gpus(host_env) if host is not None
                 else [str(i) for i in range(HOST_GPUS)])
    sets = (None if launcher.get("share") else launch_gpus.worker_gpus(
        host_gpus, 2, launcher["gpus_per_worker"]))
    specs = local.worker_specs(["train"], 2, [1111, 1112], host_env,
                               gpu_sets=sets)
    for spec, count in zip(specs, expected):
        with monkeypatch.context() as patch:
            cuda_listing(patch, spec.env)
            info = resolve_cluster(spec.env)
            resolver = strategies.multi_worker_resolver(
                info, devices.visible_gpus())
        assert resolver.num_accelerators() == ({"GPU": count} if count
                                               else {})
        picked = tensorflow_devices(resolver, info.task_index)
        assert [d.rsplit("device:", 1)[1] for d in picked] == (
            [f"GPU:{i}" for i in range(count)] or ["CPU:0"])


def split_one_gpu(monkeypatch):
    """TensorFlow's listing of one GPU split in two logical devices."""
    fake = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "get_visible_devices",
                        lambda device_type=None: [fake])
    monkeypatch.setattr(
        tf.config, "get_logical_device_configuration",
        lambda device: [tf.config.LogicalDeviceConfiguration(1024)] * 2)


def test_logical_gpus_count_as_tensorflow_counts_them(monkeypatch):
    """One GPU split in two logical devices: two replicas, as TensorFlow's
    own count (`context.num_gpus()`) gives."""
    split_one_gpu(monkeypatch)
    assert devices.visible_gpus() == ("/device:GPU:0", "/device:GPU:1")


MWMS_DEVICES = """
import json, sys
import tensorflow as tf
from tfscale.cluster import strategies
from tfscale.cluster.environment import resolve_cluster
info = resolve_cluster({"TF_CONFIG": json.dumps({
    "cluster": {"worker": [sys.argv[1]]}, "task": {"type": "worker",
                                                   "index": 0}})})
if sys.argv[2] == "bare":
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(dict(info.cluster)), task_type="worker",
        task_id=0, rpc_layer="grpc")
else:
    resolver = strategies.multi_worker_resolver(
        info, ["/device:GPU:0"] * int(sys.argv[2]))
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    cluster_resolver=resolver)
print("DEVICES", json.dumps(strategy.extended.worker_devices))
"""


@pytest.mark.parametrize("gpus,expected", [
    ("bare", ["CPU:0"]), ("2", ["GPU:0", "GPU:1"])])
def test_a_real_mwms_puts_replicas_where_the_resolver_says(gpus, expected):
    """TensorFlow's own MultiWorkerMirroredStrategy (its own process: one a
    process) reads the resolver: a bare SimpleClusterResolver gives the
    CPU (fact 36), tfscale's gives the worker's GPUs."""
    with local.ports.lease(1, "127.0.0.1") as held:
        address = f"127.0.0.1:{held.ports[0]}"
    code, output = run_command([sys.executable, "-c", MWMS_DEVICES, address,
                                gpus], timeout=120)
    assert code == 0, output[-3000:]
    line = next(l for l in output.splitlines() if l.startswith("DEVICES "))
    assert [d.rsplit("device:", 1)[1] for d in json.loads(line[8:])] == \
        expected


def small_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                             keras.layers.Dense(1)])


def test_cpu_replicas_are_refused_while_the_worker_sees_a_gpu():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with pytest.raises(placement.PlacementError) as raised:
        placement.check(strategy, worker="worker 1",
                        gpus=("/device:GPU:0",))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("worker 1 sees 1 GPU (GPU:0) but its strategy "
                              "put its replicas on /job:localhost/replica:0/"
                              "task:0/device:CPU:0")
    assert "CUDA_VISIBLE_DEVICES=" in message


def test_variables_off_the_gpu_are_refused_naming_one():
    """Replicas on a GPU, variables on the CPU (on this CPU machine soft
    placement puts a "/gpu:0" strategy's variables there): refused."""
    strategy = tf.distribute.MirroredStrategy(["/gpu:0"])
    with strategy.scope():
        model = small_model()
    with pytest.raises(placement.PlacementError,
                       match=r"^worker 0 sees 1 GPU \(GPU:0\) and its "
                             r"replicas are on GPU:0, but variable "
                             r"sequential\S*/dense\S*/kernel is on "
                             r"/job:localhost/replica:0/task:0/device:CPU:0"):
        placement.check(strategy, model.trainable_variables,
                        gpus=("/device:GPU:0",))


def test_a_cpu_worker_that_sees_no_gpu_passes_and_says_where_it_is():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = small_model()
    where = placement.check(strategy, model.trainable_variables, gpus=())
    assert where.describe() == (
        "placement: 2 replicas on CPU:0, CPU:1, variables on CPU:0, CPU:1 "
        "(worker 0 sees no GPU)")
    gpu = placement.Placement("worker 3", ("/device:GPU:0",),
                              ("/job:worker/replica:0/task:3/device:GPU:0",),
                              ("/job:worker/replica:0/task:3/device:GPU:0",))
    assert gpu.describe() == ("placement: 1 replica on GPU:0, variables on "
                              "GPU:0 (worker 3 sees 1 GPU: GPU:0)")


def test_the_trainer_checks_before_its_first_step(monkeypatch):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = small_model()
        optimizer = keras.optimizers.SGD(0.1)
    trainer = Trainer(model=model, optimizer=optimizer, loss_fn=keras.losses.
                      MeanSquaredError(), strategy=strategy,
                      config=TrainConfig(global_batch_size=8, verbose=0))
    assert trainer.placement.describe().startswith(
        "placement: 1 replica on CPU:0, variables on CPU:0")
    cuda_listing(monkeypatch, {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(placement.PlacementError,
                       match="^worker 0 sees 1 GPU"):
        Trainer(model=model, optimizer=optimizer,
                loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
                config=TrainConfig(global_batch_size=8, verbose=0))


def test_keras_fit_on_many_replicas_checks_before_training(monkeypatch):
    import tfscale
    tfscale.enable_multi_worker_fit()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = small_model()
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 4), "float32")
    cuda_listing(monkeypatch, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(placement.PlacementError,
                       match=r"^worker 0 sees 2 GPUs \(GPU:0, GPU:1\) but"):
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)


# The all-reduce's implementation (`tfscale/cluster/all_reduce_impl.py`):
# TensorFlow 2.21's AUTO is the gRPC ring on GPUs too, so tfscale picks.

@pytest.mark.parametrize("env,alg,expected", [
    # Each worker its own GPU (launch.local's default binding): NCCL.
    ({"CUDA_VISIBLE_DEVICES": "0"}, "auto", "NCCL"),
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, "auto", "NCCL"),
    # --share_gpus: the ring.
    ({"CUDA_VISIBLE_DEVICES": "0", SHARED_GPUS_ENV: "1"}, "auto", "RING"),
    # No GPU: the ring (nccl too: a GPU cluster's command line on CPUs).
    ({"CUDA_VISIBLE_DEVICES": ""}, "auto", "RING"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "nccl", "RING"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "ring", "RING"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "nccl", "NCCL")])
def test_make_strategy_picks_nccl_where_each_replica_has_its_own_gpu(
        monkeypatch, env, alg, expected):
    cuda_listing(monkeypatch, env)
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                        RecordingMwms)
    monkeypatch.setattr(strategies, "start_coordination", lambda *a: None)
    strategy = strategies.make_strategy(
        two_worker_info(env=env), ClusterConfig(all_reduce_alg=alg))
    options = strategy.extended._communication_options
    assert options.implementation.name == expected
    said = all_reduce_impl.describe(strategy, ClusterConfig(
        all_reduce_alg=alg))
    assert said == expected.lower() + (
        " (auto)" if alg == "auto" else
        "" if alg.upper() == expected else
        f" (--all_reduce_alg={alg}: no GPU here)")


def test_nccl_where_it_cannot_run_is_one_line_naming_the_worker():
    for ids, shared, problem in (
            (("h/cuda:0",), True, "the host's workers share its GPUs"),
            (("h/cuda:0", "h/cuda:0"), False,
             "it holds two replicas on h/cuda:0")):
        with pytest.raises(ConfigError, match=(
                f"^--all_reduce_alg=nccl: worker 1: {problem}")):
            all_reduce_impl.choose("nccl", ids, shared, "worker 1")
        choice = all_reduce_impl.choose("auto", ids, shared, "worker 1")
        assert choice.implementation == "ring"
        assert choice.why.startswith(f"auto: {problem}")
    for alg in ("auto", "nccl"):
        assert all_reduce_impl.choose(alg, (), False, "worker 1") == \
            all_reduce_impl.Choice("ring", "it sees no GPU")


def test_gpu_ids_name_the_cuda_devices_behind_the_logical_ones(monkeypatch):
    cuda_listing(monkeypatch, {"CUDA_VISIBLE_DEVICES": "1,3"})
    assert all_reduce_impl.gpu_ids("1,3", "h") == (
        "h/cuda:1", "h/cuda:3")
    cuda_listing(monkeypatch, {})
    assert all_reduce_impl.gpu_ids(None, "h") == tuple(
        f"h/cuda:{i}" for i in range(HOST_GPUS))
    # One GPU split in two logical devices: two replicas on one GPU.
    split_one_gpu(monkeypatch)
    assert all_reduce_impl.gpu_ids("GPU-ab", "h") == ("h/cuda:GPU-ab",) * 2
    assert all_reduce_impl.shared_gpu({0: ["a/cuda:0"], 1: ["b/cuda:0"]}) \
        is None
    assert all_reduce_impl.shared_gpu(
        {0: ["a/cuda:0", "a/cuda:1"], 2: ["a/cuda:1"]}) == ("a/cuda:1", (0, 2))


def fake_nvidia_smi(tmp_path, name, uuids):
    """An `nvidia-smi` whose `-L` lists `uuids` as GPUs 0, 1, ..."""
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: {u})'\n"
                    for i, u in enumerate(uuids))
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{lines}")
    path.chmod(0o755)
    return str(path)


def test_gpu_uuids_tell_gpus_apart_where_indices_do_not(tmp_path):
    # SLURM confining each task to its GPU (ConstrainDevices): both tasks
    # see CUDA device 0, nvidia-smi lists each its own GPU.
    first = fake_nvidia_smi(tmp_path, "a", [UUIDS[0]])
    second = fake_nvidia_smi(tmp_path, "b", [UUIDS[1]])
    assert all_reduce_impl.gpu_uuids("0", 1, first) == (UUIDS[0],)
    assert all_reduce_impl.gpu_uuids("0", 1, second) == (UUIDS[1],)
    assert all_reduce_impl.shared_gpu({0: (UUIDS[0],), 1: (UUIDS[1],)}) \
        is None
    # One host, every GPU listed: CUDA_VISIBLE_DEVICES picks them.
    both = fake_nvidia_smi(tmp_path, "c", UUIDS)
    assert all_reduce_impl.gpu_uuids("1", 1, both) == (UUIDS[1],)
    assert all_reduce_impl.gpu_uuids(None, 2, both) == tuple(UUIDS)
    # UUIDs in the variable need no listing; unknown: no UUIDs at all.
    assert all_reduce_impl.gpu_uuids(UUIDS[1], 1, "/nonexistent") == (
        UUIDS[1],)
    assert all_reduce_impl.gpu_uuids("0", 1, "/nonexistent") == ()
    assert all_reduce_impl.gpu_uuids("3", 1, both) == ()


NCCL_PEERS = """
import json, sys
from tfscale.cluster import all_reduce_impl, strategies
from tfscale.cluster.environment import ClusterConfig, resolve_cluster
from tfscale import _compat
info = resolve_cluster({"TF_CONFIG": json.dumps({
    "cluster": {"worker": sys.argv[1].split(",")},
    "task": {"type": "worker", "index": int(sys.argv[2])}})})
strategy = strategies.make_strategy(info, ClusterConfig())
all_reduce_impl.check_not_shared(
    _compat.coordination_service(), info.worker_index, info.num_workers,
    sys.argv[3].split(","), 60)
print("NOT SHARED")
"""


UUIDS = ["GPU-5f0e2a4c-0000", "GPU-9b7d11e3-0001"]


@pytest.mark.parametrize("gpus,shared", [
    (UUIDS, False), ([UUIDS[0], UUIDS[0]], True)])
def test_workers_on_nccl_compare_their_gpus_before_the_first_collective(
        gpus, shared):
    """Two real workers (CPU MWMS, its coordination service) publish the
    UUIDs of the GPUs they would run NCCL on: two on one GPU both stop in
    one line."""
    import subprocess
    with local.ports.lease(2, "127.0.0.1") as held:
        addresses = ",".join(f"127.0.0.1:{p}" for p in held.ports)
    procs = [subprocess.Popen(
        [sys.executable, "-c", NCCL_PEERS, addresses, str(i), gpus[i]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), cwd=REPO)
        for i in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    if not shared:
        assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:]
        assert all("NOT SHARED" in out for out in outputs)
        return
    assert [p.returncode for p in procs] == [2, 2], "\n".join(
        out[-2000:] for out in outputs)
    for out in outputs:
        assert ("ConfigError: all-reduce over NCCL: worker 0 and worker 1 "
                f"both use the GPU {UUIDS[0]}; NCCL needs one GPU of its own "
                "a replica") in out, out[-3000:]


def test_launch_local_tells_workers_sharing_gpus_that_they_share():
    script = f"import os; print('SHARED', os.environ.get('{SHARED_GPUS_ENV}'))"
    for flags, said in ((["--share_gpus"], "1"), ([], "None")):
        code, output = run_command(
            [sys.executable, "-m", "launch.local", "--num_workers", "2",
             *flags, "--", sys.executable, "-c", script], timeout=60)
        assert code == 0, output
        assert output.count(f"SHARED {said}") == 2, output


def test_a_job_names_nccl_on_a_shared_gpu_in_one_line_and_no_restart(
        monkeypatch, tmp_path):
    from tfscale import jobs

    def refuse(info, cluster):
        return all_reduce_impl.choose("nccl", ("h/cuda:0",), True,
                                      "worker 0")
    monkeypatch.setattr(strategies, "make_strategy", refuse)
    with pytest.raises(jobs.JobError) as raised:
        jobs.start_worker(ClusterConfig(all_reduce_alg="nccl"),
                          output_dir=str(tmp_path), precision="float32",
                          seed=0, deterministic=False)
    assert not raised.value.restartable
    assert str(raised.value).startswith(
        "--all_reduce_alg=nccl: worker 0: the host's workers share its GPUs")


def test_the_trainer_checks_every_variable_once_the_slots_exist(
        monkeypatch):
    """After the optimizer is built, its slots (and the model's other
    variables) are checked too, not only the trainable ones (mutation
    tried: the second check removed -> fails)."""
    from tfscale.trainer import parts
    checked = []
    real = placement.check

    def recording(strategy, variables=(), **kwargs):
        checked.append([getattr(v, "path", v.name) for v in variables])
        return real(strategy, variables, **kwargs)
    monkeypatch.setattr(parts.placement, "check", recording)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = small_model()
        optimizer = keras.optimizers.Adam(0.1)
    Trainer(model=model, optimizer=optimizer,
            loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
            config=TrainConfig(global_batch_size=8, verbose=0))
    slots = [v.path for v in optimizer.variables]
    assert any("momentum" in s or "velocity" in s for s in slots)
    assert set(slots) <= set(checked[-1])


def test_a_slot_off_the_gpu_is_refused_naming_it():
    """A plain tf.Variable (the sharded update's slots are) on the CPU
    while the worker's replicas are on its GPU."""
    strategy = tf.distribute.MirroredStrategy(["/gpu:0"])
    with tf.device("/cpu:0"):
        slot = tf.Variable(tf.zeros([4]), name="sharded_m")
    with pytest.raises(placement.PlacementError,
                       match=r"but variable sharded_m\S* is on "
                             r"/job:localhost/replica:0/task:0/device:CPU:0"):
        placement.check(strategy, [slot], gpus=("/device:GPU:0",))


def test_a_users_trainer_says_where_it_trains_once(capsys):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = small_model()
        optimizer = keras.optimizers.SGD(0.1)
    said = {}
    for name, fields in (("default", {}), ("quiet", dict(verbose=0)),
                         ("jobs", dict(say_placement=False))):
        Trainer(model=model, optimizer=optimizer,
                loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
                config=TrainConfig(global_batch_size=8, **fields))
        said[name] = [line for line in capsys.readouterr().out.splitlines()
                      if "placement:" in line]
    assert said["default"] == [
        "tfscale: placement: 1 replica on CPU:0, variables on CPU:0 "
        "(worker 0 sees no GPU)"]
    assert said["quiet"] == said["jobs"] == []


def test_keras_fit_says_where_it_trains_once_per_worker(capsys):
    import tfscale
    tfscale.enable_multi_worker_fit()
    # One replica: no collective (a second MirroredStrategy over two CPUs
    # in one process can collide with another's collective instance keys).
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = small_model()
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 4), "float32")
    for _ in range(2):
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=2)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    said = [line for line in capsys.readouterr().out.splitlines()
            if "placement:" in line]
    assert said == ["tfscale: placement: 1 replica on CPU:0, variables on "
                    "CPU:0 (worker 0 sees no GPU)"]
