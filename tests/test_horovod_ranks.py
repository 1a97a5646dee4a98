"""tfscale.horovod on 2 real ranks started by tfscale-run (Open MPI):
Horovod's documented semantics with Keras 3 and tf_keras, the three
Horovod-shaped example scripts, and bad input (one line naming the op,
ranks and shapes; ranks that never arrive; a rank that dies)."""

import json
import os
import sys

import numpy as np
import pytest

from tests.conftest import REPO, run_command

pytestmark = pytest.mark.slow


def tfscale_run(*args, timeout=300, env=None):
    command = [sys.executable, "-m", "launch.horovodrun", "-np", "2", "-H",
               "localhost:2", *args]
    return run_command(command, timeout=timeout, env=env)


def worker(name):
    return os.path.join(REPO, "tests", "workers", name)


def example(name):
    return os.path.join(REPO, "examples", "horovod", name)


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_horovod_semantics_on_two_ranks(tmp_path, keras):
    env = {"TF_USE_LEGACY_KERAS": "1"} if keras == "tf_keras" else {
        "TF_USE_LEGACY_KERAS": "0"}
    code, output = tfscale_run(sys.executable, worker("horovod_semantics.py"),
                               str(tmp_path), env=env)
    assert code == 0, output[-8000:]
    assert "[worker 0] rank 0: done" in output
    assert "[worker 1] rank 1: done" in output
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text())
             for r in range(2)]
    zero, one = ranks
    legacy = zero["keras"].startswith("tf_keras")
    assert legacy == (keras == "tf_keras"), zero["keras"]
    for r, got in enumerate(ranks):
        assert (got["rank"], got["size"], got["local_rank"],
                got["local_size"], got["cross_size"]) == (r, 2, r, 2, 1)
        # Rank r holds [1, 2, 3] * (r + 1).
        assert got["average"] == [1.5, 3.0, 4.5]
        assert got["sum"] == got["average_flag"] == [3.0, 6.0, 9.0]
        assert got["min"] == [1.0, 2.0, 3.0] and got["max"] == [2.0, 4.0, 6.0]
        assert got["scaled"] == [3.0, 6.0, 9.0]
        assert got["int_sum"] == [3, 20]
        assert got["grouped"] == [[3.0, 6.0, 9.0], [[1]], [1.0]]
        # Uneven first dimensions, in rank order.
        assert got["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert got["allgather_int"] == [0, 1, 0, 1, 2]
        assert got["broadcast"] == [1, 10]
        assert got["broadcast_object"] == {"from": 1}
        assert got["allgather_object"] == ["rank0", "rank1"]
        assert got["in_tf_function"] == [[3.0, 6.0, 9.0], [1.0, 2.0, 4.0],
                                         [2.0, 4.0, 6.0]]
        assert got["allreduce_grad"] == [2.0, 4.0, 6.0]
        assert got["fp16_dtype"] == "float32"
        assert got["fp16_error_over_bound"] <= 1.0
        assert 0 < got["fp16_max_abs_error"]  # it did travel as float16
        assert got["tape_max_diff"] < 1e-6
        assert got["tape_fp16_predivide_max_diff"] < 2e-3
        assert got["fit_iterations"] == 4
        assert got["fit_accumulation_max_diff"] < 1e-6
        assert got["fit_ranks_max_diff"] == 0.0
        history, means = got["metric_history"], got["metric_mean_of_ranks"]
        for key in ("loss", "mae"):
            np.testing.assert_allclose(history[key], means[key], rtol=1e-6)
        np.testing.assert_allclose(got["warmup_batch_lr"],
                                   got["warmup_expected_batch_lr"], rtol=1e-6)
        np.testing.assert_allclose(got["warmup_epoch_lr"],
                                   [0.075, 0.1, 0.1], rtol=1e-6)
        assert got["checkpoint_max_diff"] == 0.0
        assert got["join_last"] == 0
        assert got["optimizer_variables_callable"]
    # The ranks' own metrics differ (other data), so averaging did something.
    assert zero["metric_local"][0]["loss"] != one["metric_local"][0]["loss"]
    assert zero["join_sums"] == [[1.0, 1.0], [1.0, 1.0]]
    assert zero["join_average"] == [0.5, 0.5]
    assert "Epoch 2: finished gradual learning rate warmup to 0.1." in output


def test_horovod_shaped_scripts_run_on_two_ranks(tmp_path):
    code, output = tfscale_run(
        "--verbose", sys.executable, example("keras_mnist.py"), "--epochs",
        "3", "--steps-per-epoch", "20", "--checkpoint-dir",
        str(tmp_path / "keras"))
    assert code == 0, output[-8000:]
    assert "[launcher] " in output and "-H localhost:2" in output
    final = [line for line in output.splitlines() if "final: loss" in line]
    assert len(final) == 1 and final[0].startswith("[worker 0]"), final
    accuracy = float(final[0].split("accuracy ")[1].split()[0])
    assert accuracy > 0.3, final   # 10 classes: chance is 0.1
    assert "lr 0.002000" in final[0]  # warmed up to 0.001 x 2 ranks
    assert sorted(os.listdir(tmp_path / "keras")) == [
        f"checkpoint-{e}.weights.h5" for e in (1, 2, 3)]

    code, output = tfscale_run(sys.executable, example("tape_mnist.py"),
                               "--steps", "30", "--checkpoint-dir",
                               str(tmp_path / "tape"))
    assert code == 0, output[-8000:]
    assert "weight spread across ranks 0" in output, output[-3000:]
    assert any(n.startswith("ckpt-1") for n in os.listdir(tmp_path / "tape"))

    result = tmp_path / "synthetic.json"
    code, output = tfscale_run(
        # (A smaller model than the default ResNet50: the script's shape is
        # what is tested, and its --model is Horovod's.)
        sys.executable, example("synthetic_benchmark.py"), "--model",
        "MobileNetV2", "--image-size", "32", "--batch-size", "4", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "1", "--num-iters", "2",
        "--fp16-allreduce", "--json-out", str(result), timeout=600)
    assert code == 0, output[-8000:]
    assert "Total img/sec on 2 CPU(s)" in output
    measured = json.loads(result.read_text())
    assert measured["images_per_second"] > 0
    assert measured["weight_spread"] == 0.0
    # (Without a launcher a script is size 1: tests/test_horovod.py.)


def test_ranks_that_disagree_fail_with_one_line_naming_op_ranks_shapes():
    code, output = tfscale_run(sys.executable, worker("horovod_bad.py"),
                               "mismatch", timeout=120)
    assert code == 0, output[-6000:]
    for rank in (0, 1):
        for what, line in [
                ("eager", " mismatched allreduce 'grads': rank 0 called "
                          "allreduce 'grads' with float32[2, 3], rank 1 "
                          "called allreduce 'grads' with float32[3, 3] "
                          "(every rank must pass the same shapes and "
                          "dtypes)"),
                ("graph", " mismatched allreduce 'grads': rank 0 called "
                          "allreduce 'grads' with float32[2, 3], rank 1 "
                          "called allreduce 'grads' with float32[3, 3]"),
                ("dtype", " mismatched allreduce 'loss': rank 0 called "
                          "allreduce 'loss' with float32[3], rank 1 called "
                          "allreduce 'loss' with float64[3]"),
                ("extra", " mismatched allreduce 'grads': rank 0 called "
                          "allreduce 'grads' with float32[2], rank 1 called "
                          "allreduce 'extra' with float32[2] (every rank "
                          "must issue the same collectives, by name, in the "
                          "same order)")]:
            assert any(l.startswith(f"[worker {rank}] rank {rank}: {what}:")
                       and line in l for l in output.splitlines()), (
                what, output[-6000:])
        assert f"[worker {rank}] rank {rank}: after: [2.]" in output
    assert "no error" not in output


def test_a_rank_that_never_arrives_or_dies_is_named(tmp_path):
    code, output = tfscale_run("--start-timeout", "4", sys.executable,
                               worker("horovod_bad.py"), "late", timeout=120)
    assert code != 0
    assert ("[worker 0] tfscale: rank 0 could not start the cluster within "
            "4s (the other ranks did not all start: --start-timeout)"
            ) in output, output[-4000:]
    # Its own code (not 137, an out-of-memory kill to a scheduler).
    assert "[launcher] exit 40: worker 0 failed (exit code 40)" in output
    code, output = tfscale_run(sys.executable, worker("horovod_bad.py"),
                               "crash", timeout=120)
    assert code != 0, output[-4000:]
    assert "[worker 1] RuntimeError: out of memory (pretend)" in output
    assert ("[worker 1] tfscale: rank 1 failed: RuntimeError: out of memory "
            "(pretend); ending the job") in output
    assert ("[launcher] worker 1 failed (exit code 1): tfscale: rank 1 "
            "failed: RuntimeError: out of memory (pretend); ending the job"
            ) in output
    assert "no error" not in output
    code, output = tfscale_run(sys.executable, worker("horovod_bad.py"), "xla",
                               timeout=120)
    assert code != 0
    assert "cannot run inside an XLA-compiled function" in output


def check_placement(tmp_path, device):
    code, output = tfscale_run(sys.executable, worker("horovod_devices.py"),
                               device, str(tmp_path), timeout=120)
    assert code == 0, output[-6000:]
    want = device.split(":")[-1]
    for r in range(2):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        for mode in ("eager", "graph"):
            assert got[mode]["allreduce"]["values"] == [3.0, 6.0, 9.0]
            assert got[mode]["allgather"]["values"] == [1, 2, 3, 2, 4, 6]
            assert got[mode]["broadcast"]["values"] == [2.0, 4.0, 6.0]
        assert [t["values"] for t in got["eager"]["grouped"]] == [
            [3.0, 6.0, 9.0], [[3.0]]]
        # Eager results come back where the input was.
        for result in [got["eager"]["allreduce"], got["eager"]["allgather"],
                       got["eager"]["broadcast"], *got["eager"]["grouped"]]:
            assert result["device"].upper().endswith(
                f"{device.split(':')[0].strip('/').upper()}:{want}"), result
        # Rank 0's variables everywhere, still on the device.
        assert [v["values"] for v in got["variables"]] == [[[5.0] * 3] * 2,
                                                          [1.0]]
        assert all(d.upper().endswith(device.strip("/").upper())
                   for d in got["variable_devices"]), got["variable_devices"]


def test_collectives_return_on_the_inputs_device(tmp_path):
    """Inputs on a second (logical) CPU: values right, results on it."""
    check_placement(tmp_path, "/cpu:1")


@pytest.mark.skipif(not __import__("glob").glob("/dev/nvidia[0-9]*"),
                    reason="needs a GPU")
def test_collectives_on_a_gpu_fill_the_gpu_tensors(tmp_path):
    """Inputs on GPU 0: MPI works on host buffers, results are copied back
    (a device output filled through a host copy would be garbage)."""
    check_placement(tmp_path, "/gpu:0")
