"""Each process on its own GPUs (`tfscale/cluster/gpu_binding.py`) and NCCL
named before the first collective (`all_reduce_impl.load_nccl`).

The GPU tests feed what TensorFlow decides from: a CUDA listing of the GPUs
a process sees, the launchers' variables (local rank, workers on the host,
bound or shared), and record what `tf.config` is then told. The NCCL tests
load a real shared library (a stand-in `libnccl.so.2` built with the C
compiler) through ctypes, from the folders TensorFlow's loader searches.
"""

import os
import shutil
import subprocess

import pytest
import tensorflow as tf

from launch import local
from tfscale.cluster import all_reduce_impl, gpu_binding, strategies
from tfscale.cluster.contract import GPUS_BOUND_ENV
from tfscale.cluster.environment import ClusterConfig, resolve_cluster
from tfscale.errors import ConfigError


class FakeGpus:
    """TensorFlow's GPU listing on a host with `count` GPUs, before the
    runtime starts (`started`: after, when visibility cannot change)."""

    def __init__(self, monkeypatch, count, started=False):
        self.all = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}",
                                             "GPU") for i in range(count)]
        self.visible = list(self.all)
        self.growth = []
        self.started = started
        listed, configured = (tf.config.get_visible_devices,
                              tf.config.get_logical_device_configuration)
        monkeypatch.setattr(
            tf.config, "get_visible_devices",
            lambda device_type=None: (list(self.visible) if device_type
                                      == "GPU" else listed(device_type)))
        monkeypatch.setattr(tf.config, "set_visible_devices",
                            self.set_visible_devices)
        monkeypatch.setattr(
            tf.config, "get_logical_device_configuration",
            lambda device: None if device in self.all else configured(device))
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                            lambda device, on: self.growth.append(device.name))

    def set_visible_devices(self, devices, device_type=None):
        assert device_type == "GPU"
        if self.started and list(devices) != self.visible:
            raise RuntimeError("Visible devices cannot be modified after "
                               "being initialized")
        self.visible = list(devices)

    def names(self):
        return [d.name.rsplit(":", 1)[1] for d in self.visible]


@pytest.mark.parametrize("seen,kwargs,keep,growth,shared", [
    # An MPI rank (one replica) keeps the GPU of its local rank.
    (4, dict(one_per_process=True, local_rank=2, local_workers=4),
     (2,), False, False),
    # 8 ranks on 4 GPUs: two a GPU, memory growth, shared.
    (4, dict(one_per_process=True, local_rank=5, local_workers=8),
     (1,), True, True),
    # A rank bound to its GPU keeps it.
    (1, dict(one_per_process=True, local_rank=3, local_workers=4,
             bound=True), None, False, False),
    # Two unbound MWMS workers on 8 GPUs: 4 each, by local rank.
    (8, dict(one_per_process=False, local_rank=1, local_workers=2),
     (4, 5, 6, 7), False, False),
    # Bound by the launcher (2 a worker): both kept.
    (2, dict(one_per_process=False, local_rank=1, local_workers=2,
             bound=True), None, False, False),
    # One worker on the host: every GPU it sees is its own.
    (8, dict(one_per_process=False, local_rank=0, local_workers=None),
     None, False, False),
    # Three workers, two GPUs: shared.
    (2, dict(one_per_process=False, local_rank=2, local_workers=3),
     None, True, True),
    # launch.local --share_gpus: shared on purpose.
    (1, dict(one_per_process=False, local_rank=1, local_workers=2,
             shared_by_launcher=True), None, True, True),
    # No GPU: nothing to do.
    (0, dict(one_per_process=True, local_rank=1, local_workers=2),
     None, False, False),
])
def test_a_process_keeps_its_own_gpus(seen, kwargs, keep, growth, shared):
    binding = gpu_binding.decide(seen, worker="worker 1", **kwargs)
    assert (binding.keep, binding.memory_growth, binding.shared) == (
        keep, growth, shared)
    if keep is not None or (shared and not kwargs.get("shared_by_launcher")):
        assert binding.line and binding.line.startswith("worker 1")
        if shared or not kwargs["one_per_process"]:
            assert "--gpus_per_worker" in binding.line


def host_worker_env(index, num_workers=2, **extra):
    """Worker `index` of launch.local's `num_workers` on this host, as its
    environment says (TF_CONFIG, local rank, bound or not)."""
    (spec,) = [s for s in local.worker_specs(
        ["train"], num_workers, [23001 + i for i in range(num_workers)],
        {}, gpu_sets=extra.pop("gpu_sets", None)) if s.index == index]
    return dict(spec.env, **extra)


class RecordingMwms:
    made = []

    def __init__(self, cluster_resolver, communication_options):
        RecordingMwms.made.append((cluster_resolver, communication_options))
        self.cluster_resolver = cluster_resolver
        count = cluster_resolver.num_accelerators().get("GPU", 0)
        self.extended = type("Extended", (), {
            "worker_devices": tuple(
                f"/job:worker/replica:0/task:1/device:GPU:{i}"
                for i in range(count)) or (
                "/job:worker/replica:0/task:1/device:CPU:0",),
            "_communication_options": communication_options})()

    def run(self, fn):
        return fn()

    def reduce(self, op, value, axis):
        return value


@pytest.fixture
def recording_mwms(monkeypatch):
    RecordingMwms.made.clear()
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                        RecordingMwms)
    monkeypatch.setattr(strategies, "check_own_port", lambda info: None)
    monkeypatch.setattr(strategies, "start_coordination", lambda *a: None)
    return RecordingMwms.made


def test_an_unbound_worker_on_a_many_gpu_host_keeps_its_share(
        monkeypatch, recording_mwms):
    """launch.local on a host whose nvidia-smi is missing binds nothing:
    each of its 2 workers sees all 4 GPUs and keeps 2 by its local rank
    (mutation tried: the bind call removed from make_strategy -> the
    resolver counts 4 GPUs and this fails)."""
    gpus = FakeGpus(monkeypatch, 4)
    monkeypatch.setattr(all_reduce_impl, "load_nccl", lambda *a: None)
    env = host_worker_env(1)
    assert "CUDA_VISIBLE_DEVICES" not in env and GPUS_BOUND_ENV not in env
    strategies.make_strategy(resolve_cluster(env),
                             ClusterConfig(all_reduce_alg="ring"))
    assert gpus.names() == ["2", "3"]
    ((resolver, _),) = recording_mwms
    assert resolver.num_accelerators() == {"GPU": 2}


def test_a_bound_worker_keeps_what_its_launcher_gave_it(
        monkeypatch, recording_mwms):
    gpus = FakeGpus(monkeypatch, 2)  # CUDA_VISIBLE_DEVICES=2,3 renumbered
    env = host_worker_env(1, gpu_sets=["0,1", "2,3"])
    assert env[GPUS_BOUND_ENV] == "1"
    strategies.make_strategy(resolve_cluster(env),
                             ClusterConfig(all_reduce_alg="ring"))
    assert gpus.names() == ["0", "1"]
    assert recording_mwms[0][0].num_accelerators() == {"GPU": 2}


def test_workers_sharing_too_few_gpus_grow_memory_and_take_the_ring(
        monkeypatch, recording_mwms):
    """Three workers, one GPU, nothing bound: growth on, and `auto` takes
    the ring (NCCL would refuse two ranks on one GPU)."""
    gpus = FakeGpus(monkeypatch, 1)
    env = host_worker_env(2, num_workers=3)
    strategies.make_strategy(resolve_cluster(env), ClusterConfig())
    assert gpus.growth == ["/physical_device:GPU:0"]
    ((_, options),) = recording_mwms
    assert options.implementation.name == "RING"


def test_an_mpi_rank_keeps_the_gpu_of_its_local_rank(monkeypatch):
    gpus = FakeGpus(monkeypatch, 4)
    info = resolve_cluster({"OMPI_COMM_WORLD_RANK": "3",
                            "OMPI_COMM_WORLD_SIZE": "4",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
                           backend="mpi")
    assert (info.local_rank, info.local_workers) == (3, 4)
    binding = gpu_binding.bind(info, one_per_process=True, worker="rank 3")
    assert binding.keep == (3,)
    assert gpus.names() == ["3"]
    assert not gpus.growth


def test_a_started_runtime_is_one_line_naming_the_worker_and_the_flag(
        monkeypatch):
    FakeGpus(monkeypatch, 8, started=True)
    info = resolve_cluster(host_worker_env(1))
    with pytest.raises(ConfigError) as raised:
        gpu_binding.bind(info, one_per_process=False, worker="worker 1")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("worker 1 sees 8 GPUs")
    assert "--gpus_per_worker" in message


def test_launch_local_says_each_worker_its_local_rank_and_binding():
    specs = local.worker_specs(["train"], 3, [1, 2, 3], {},
                               gpu_sets=["0", "1", "2"])
    for spec in specs:
        info = resolve_cluster(spec.env)
        assert (info.local_rank, info.local_workers, info.gpus_bound) == (
            spec.index, 3, True)
    unbound = local.worker_specs(["train"], 2, [1, 2], {})
    assert not resolve_cluster(unbound[1].env).gpus_bound


# ---- NCCL ----

FAKE_NCCL = "int ncclGetVersion(int *v) { *v = 22707; return 0; }\n"


def build_fake_nccl(folder) -> str:
    """A shared library named libnccl.so.2 in `folder` that answers
    ncclGetVersion with 2.27.7."""
    if not shutil.which("cc"):
        pytest.skip("no C compiler to build a stand-in NCCL")
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, "nccl.c")
    with open(source, "w") as f:
        f.write(FAKE_NCCL)
    path = os.path.join(folder, all_reduce_impl.NCCL_LIBRARY)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", path, source],
                   check=True)
    return path


def test_nccl_is_looked_for_where_tensorflow_looks(tmp_path):
    tensorflow_dir = str(tmp_path / "site" / "tensorflow")
    places = all_reduce_impl.nccl_places(tensorflow_dir, "/opt/a:/opt/b")
    assert places == [
        "/opt/a/libnccl.so.2", "/opt/b/libnccl.so.2",
        str(tmp_path / "site" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"),
        str(tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"),
        "libnccl.so.2"]


def test_nccl_from_the_pip_wheels_folder_is_loaded_with_its_version(
        tmp_path):
    site = tmp_path / "site"
    path = build_fake_nccl(str(site / "nvidia" / "nccl" / "lib"))
    found = all_reduce_impl.load_nccl("worker 0", "",
                                      str(site / "tensorflow"))
    assert found == all_reduce_impl.NcclLibrary(path, "2.27.7")
    # LD_LIBRARY_PATH comes first, as for TensorFlow's loader.
    other = build_fake_nccl(str(tmp_path / "lib"))
    assert all_reduce_impl.load_nccl(
        "worker 0", str(tmp_path / "lib"), str(site / "tensorflow")
    ).path == other


def test_a_missing_nccl_is_one_line_with_the_fix(tmp_path):
    def loader(place):
        raise OSError(f"{place}: cannot open shared object file")
    with pytest.raises(ConfigError) as raised:
        all_reduce_impl.load_nccl("worker 1", "/opt/none",
                                  str(tmp_path / "tensorflow"), loader)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("all-reduce over NCCL: worker 1 cannot load "
                              "NCCL (libnccl.so.2, looked for in /opt/none")
    assert str(tmp_path / "nvidia" / "nccl" / "lib") in message
    assert 'pip install "nvidia-nccl-cu12>=2.27.7,<3"' in message
    assert "--all_reduce_alg=ring" in message
    assert raised.value.field == "all_reduce_alg"


def test_a_worker_on_nccl_loads_it_before_building_its_strategy(
        monkeypatch, recording_mwms):
    """Each worker with a GPU of its own (`auto` -> NCCL): the library is
    looked for first, and a missing one stops the worker before any peer
    is waited for (mutation tried: the load removed -> MWMS is built and
    this fails)."""
    FakeGpus(monkeypatch, 1)
    asked = []

    def missing(worker, library_path):
        asked.append((worker, library_path))
        raise ConfigError("all_reduce_alg", "all-reduce over NCCL: missing")
    monkeypatch.setattr(all_reduce_impl, "load_nccl", missing)
    env = host_worker_env(1, gpu_sets=["0", "1"], LD_LIBRARY_PATH="/x")
    with pytest.raises(ConfigError, match="all-reduce over NCCL"):
        strategies.make_strategy(resolve_cluster(env), ClusterConfig())
    assert asked == [("worker 1", "/x")]
    assert recording_mwms == []


@pytest.mark.parametrize("code,version", [(22707, "2.27.7"),
                                          (21803, "2.18.3"),
                                          (2804, "2.8.4")])
def test_nccl_version_codes(code, version):
    assert all_reduce_impl.nccl_version(code) == version


def test_this_hosts_tensorflow_has_no_nccl_or_names_it():
    """On this host (a CPU one: no NCCL wheel) the real lookup ends in the
    one line; where NCCL is installed it loads."""
    try:
        found = all_reduce_impl.load_nccl("worker 0")
    except ConfigError as e:
        assert str(e).startswith("all-reduce over NCCL: worker 0 cannot "
                                 "load NCCL")
    else:
        assert found.path.endswith("libnccl.so.2")
