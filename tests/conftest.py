"""Shared test set-up.

Two logical CPU devices are configured before TensorFlow touches a device,
so in-process tests can run `MirroredStrategy` with two replicas and no GPU.
Multi-process tests start real workers through `launch.local` (see
`run_workers`), each with a hard timeout, and print every worker's output when
they fail.

Every test starts from the same global random state, whatever ran before it:
an autouse fixture sets Keras's, TensorFlow's, NumPy's and Python's global
seeds (`keras.utils.set_random_seed`, which also drops Keras's global
SeedGenerator) before each test. `--global-seed=K` starts every test from
seed K instead of 1234; tests whose outcome depends on the seed must pass
at any K (`make test-seeds` runs the noise-scale and AdaScale tests at 20).
"""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Any seed works (0 included: tests/test_data_service.py tests it).
DEFAULT_GLOBAL_SEED = 1234


def pytest_addoption(parser):
    parser.addoption(
        "--global-seed", type=int, default=DEFAULT_GLOBAL_SEED,
        help="the global random seed every test starts from (default "
             f"{DEFAULT_GLOBAL_SEED})")


@pytest.fixture(autouse=True)
def same_global_random_state(request):
    """Sets every global seed, and Keras's global dtype policy back to
    float32, before the test, so no test's outcome depends on which tests
    ran before it in the same process (a test that builds a bf16 step, as
    benchmarks/gpu/step_kernels.py does, left the policy mixed_bfloat16)."""
    import keras
    keras.utils.set_random_seed(request.config.getoption("global_seed"))
    keras.mixed_precision.set_global_policy("float32")
    yield


def pytest_collection_modifyitems(config, items):
    """The files with multi-process tests first, each file's tests in their
    order: `make test`'s two pytest workers (a file each at a time) then end
    on short in-process files, not on one long file while the other idles."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: starts real worker processes (multi-process tests)")
    two_cpu_devices()


def two_cpu_devices():
    """Splits the CPU into two logical devices (before TensorFlow uses it)."""
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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Real text (Python's help topics) -> vocab, bert_config, records;
    one for the whole session (tests read it; those that change records
    copy them first)."""
    import json

    from input_pipelines import demo_corpus
    root = tmp_path_factory.mktemp("corpus")
    documents = demo_corpus.corpus_documents()[:30]
    (root / "corpus.txt").write_text(
        "\n\n".join("\n".join(d) for d in documents) + "\n")
    code, output = run_command(
        [sys.executable, "-m", "input_pipelines.create_pretraining_data",
         f"--input_file={root}/corpus.txt", f"--vocab_file={root}/vocab.txt",
         "--vocab_size=600", f"--output_file={root}/records/train.tfrecord",
         "--num_output_shards=4", "--max_seq_length=32",
         "--max_predictions_per_seq=5", "--dupe_factor=2"], timeout=300)
    assert code == 0, output
    vocab_size = sum(1 for _ in open(root / "vocab.txt"))
    config = demo_corpus.tiny_bert_config(-(-vocab_size // 8) * 8)
    (root / "bert_config.json").write_text(json.dumps(config))
    return root
