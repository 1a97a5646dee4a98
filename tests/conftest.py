"""Shared test set-up.

Two logical CPU devices are configured before TensorFlow touches a device,
so in-process tests can run `MirroredStrategy` with two replicas and no GPU.
Multi-process tests start real workers through `launch.local` (see
`run_workers`), each with a hard timeout, and print every worker's output when
they fail.
"""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: starts real worker processes (multi-process tests)")
    import tensorflow as tf
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:
        pass  # already initialized (e.g. by a plugin)


def run_command(command, *, timeout=240, env=None, cwd=REPO):
    """Runs a command; returns (returncode, combined output)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.run(command, cwd=cwd, env=full_env, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout


def run_workers(num_workers, module_args, *, launcher_args=(), timeout=240,
                env=None, expect_ok=True):
    """Starts `python -m <module_args>` as N workers via launch.local."""
    command = [sys.executable, "-m", "launch.local",
               "--num_workers", str(num_workers), "--threads_per_worker", "1",
               *launcher_args, "--", sys.executable, "-m", *module_args]
    code, output = run_command(command, timeout=timeout, env=env)
    if expect_ok and code != 0:
        pytest.fail(f"workers failed with {code}; output:\n{output[-20000:]}")
    return code, output


@pytest.fixture
def worker_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out
