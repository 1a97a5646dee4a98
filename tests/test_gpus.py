"""One worker, its own GPUs (`launch/gpus.py`): which GPUs a host has, which
each worker gets, through the launchers' real processes. The host's GPUs
come from a stand-in `nvidia-smi` on PATH printing what the real one prints
(`nvidia-smi -L`), so the tests run on machines with no GPU."""

import os
import stat
import sys

import pytest

from launch import gpus
from tests.conftest import run_command

LISTING = "".join(
    f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i}0000000-aaaa-bbbb-cccc-"
    f"dddddddddddd)\n" for i in range(4))
PRINT_GPUS = [sys.executable, "-c",
              "import os; print('sees', repr(os.environ.get("
              "'CUDA_VISIBLE_DEVICES')))"]


@pytest.fixture
def four_gpu_host(tmp_path):
    """PATH with an `nvidia-smi` that lists 4 GPUs; CUDA_VISIBLE_DEVICES
    unset."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n[ \"$1\" = -L ] || exit 9\ncat <<'EOF'\n"
                    + LISTING + "EOF\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items()
           if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tool.parent}{os.pathsep}{env['PATH']}"
    return env


def test_host_gpus_come_from_cuda_visible_devices_else_nvidia_smi(
        four_gpu_host, monkeypatch):
    monkeypatch.setenv("PATH", four_gpu_host["PATH"])
    assert gpus.host_gpus(four_gpu_host) == ["0", "1", "2", "3"]
    assert gpus.host_gpus({"CUDA_VISIBLE_DEVICES": "4,6"}) == ["4", "6"]
    assert gpus.host_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpus.host_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert gpus.host_gpus({}, nvidia_smi="/nonexistent/nvidia-smi") == []


def test_the_launcher_and_a_worker_read_one_nvidia_smi_listing(
        monkeypatch):
    """`nvidia-smi -L` is run and parsed in one place
    (`contract.nvidia_smi_listing`) for the launcher's GPUs and a worker's
    GPU UUIDs alike."""
    from tfscale.cluster import all_reduce_impl, contract
    asked = []

    def listing(nvidia_smi="nvidia-smi"):
        asked.append(nvidia_smi)
        return [("0", "GPU-aaa"), ("1", "GPU-bbb")]

    monkeypatch.setattr(contract, "nvidia_smi_listing", listing)
    assert gpus.host_gpus({}, nvidia_smi="smi-a") == ["0", "1"]
    assert all_reduce_impl.gpu_uuids("1", 1, "smi-b") == ("GPU-bbb",)
    assert asked == ["smi-a", "smi-b"]
    assert contract.parse_nvidia_smi_listing(
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f0e)\n"
        "  MIG 1g.10gb Device 0: (UUID: MIG-1)\n") == [("0", "GPU-5f0e")]


def test_worker_i_gets_gpus_i_k_to_i_k_plus_k_minus_1():
    four = ["0", "1", "2", "3"]
    assert gpus.worker_gpus(four, 2, 2) == ["0,1", "2,3"]
    assert gpus.worker_gpus(four, 3, None) == ["0", "1", "2"]
    assert gpus.worker_gpus(["4", "6"], 2, None) == ["4", "6"]
    assert gpus.worker_gpus([], 2, None) is None  # a CPU host: left alone
    assert gpus.worker_gpus(four, 2, 0) == ["", ""]  # CPU workers
    with pytest.raises(ValueError, match=r"--gpus_per_worker 2 x 3 worker\(s\)"
                       r" needs 6 GPUs; this host has 4 \(0,1,2,3\)"):
        gpus.worker_gpus(four, 3, 2)


def test_launch_local_gives_each_worker_its_own_gpu(four_gpu_host):
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2", "--",
         *PRINT_GPUS], env=four_gpu_host)
    assert code == 0, output
    assert "[worker 0] sees '0'" in output
    assert "[worker 1] sees '1'" in output
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2",
         "--gpus_per_worker", "2", "--", *PRINT_GPUS], env=four_gpu_host)
    assert "[worker 0] sees '0,1'" in output
    assert "[worker 1] sees '2,3'" in output


def test_too_few_gpus_is_one_line_naming_the_flag(four_gpu_host):
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "3",
         "--gpus_per_worker", "2", "--", *PRINT_GPUS], env=four_gpu_host)
    assert code == 2
    lines = [l for l in output.splitlines() if l.strip()]
    assert lines == ["tfscale-launch: error: --gpus_per_worker 2 x 3 "
                     "worker(s) needs 6 GPUs; this host has 4 (0,1,2,3)"]


def test_a_cpu_host_leaves_cuda_visible_devices_alone(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tmp_path}{os.pathsep}/usr/bin:/bin"  # no nvidia-smi
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2", "--",
         *PRINT_GPUS], env=env)
    assert code == 0, output
    assert output.count("sees None") == 2


def test_a_rank_binds_itself_by_its_local_rank(four_gpu_host):
    env = dict(four_gpu_host, CUDA_VISIBLE_DEVICES="4,5,6,7",
               OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    code, output = run_command(
        [sys.executable, "-m", "launch.gpus", "--gpus_per_worker", "2",
         "--", *PRINT_GPUS], env=env)
    assert code == 0, output
    assert "sees '6,7'" in output
    env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "3"
    code, output = run_command(
        [sys.executable, "-m", "launch.gpus", "--gpus_per_worker", "2",
         "--", *PRINT_GPUS], env=env)
    assert code == 2
    assert output.strip() == (
        "launch.gpus: error: local rank 1: --gpus_per_worker 2 x 3 worker(s)"
        " needs 6 GPUs; this host has 4 (4,5,6,7)")


@pytest.mark.slow
def test_mpi_ranks_of_launch_local_each_get_their_gpu(four_gpu_host):
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--backend", "mpi",
         "--num_workers", "2", "--", *PRINT_GPUS], env=four_gpu_host,
        timeout=120)
    assert code == 0, output
    seen = sorted(l.split("sees ")[1] for l in output.splitlines()
                  if "sees " in l)
    assert seen == ["'0'", "'1'"]


def test_shared_gpus_let_every_worker_see_the_hosts_gpu(four_gpu_host):
    """--share_gpus: two workers on a one-GPU host both see it, with memory
    growth on (a multi-worker layout tried on one GPU)."""
    env = dict(four_gpu_host, CUDA_VISIBLE_DEVICES="0")
    show = [sys.executable, "-c",
            "import os; print('sees', os.environ.get('CUDA_VISIBLE_DEVICES'),"
            " os.environ.get('TF_FORCE_GPU_ALLOW_GROWTH'))"]
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2",
         "--share_gpus", "--", *show], env=env)
    assert code == 0, output
    assert output.count("sees 0 true") == 2, output
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2", "--",
         *show], env=env)
    assert code == 2 and "needs 2 GPUs; this host has 1" in output, output
