"""The step under the device layouts a GPU run meets, on a CPU.

On GPUs tf.distribute traces a compiled function handed to `strategy.run`
per replica, where Keras's update fails (`tests/gpu_branch.py`); a CPU run
never takes that branch. These tests take it: `MirroredStrategy(["/gpu:0"])`
(soft placement runs the ops on the CPU), a single-worker
`MultiWorkerMirroredStrategy` with the GPU check answered "yes", and two
MWMS workers so patched with the optimizer state sharded. Every compiled
function of the step runs in them (the forward/backward with `--xla`, the
after-reduce work, the update, fp16's skip, the accumulation loop, the
sharded update) and must end bit-identical to the CPU layout. (Before the
compilation moved around `strategy.run`, each case with a compiled update
failed at its first step with "merge_call called while defining a new
graph".)
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import gpu_branch
from tests.conftest import run_command, run_workers
from tfscale.noise import scale as noise_lib
from tfscale import precision
from tfscale.optim.lamb import Lamb
from tfscale.trainer.loop import TrainConfig, Trainer

# What every case shares: calls of up to 3 steps, one timed step (part by
# part) per log interval of 5, so both ways of running a step are taken;
# the update compiled on both layouts (its default, auto, would compile it
# on the GPU layout only) unless a case says otherwise.
COMMON = dict(verbose=0, steps_per_execution=3, log_steps=5,
              timed_steps_per_log=1, compile_update=True)

CASES = {
    "sgd, update in XLA": (
        dict(global_batch_size=16),
        lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    "lamb, --xla: one program per step": (
        dict(global_batch_size=16, jit_compile=True),
        lambda: Lamb(0.01, weight_decay_rate=0.01)),
    "adamw, --xla, 2 micro-batches, noise scale, clipping": (
        dict(global_batch_size=32, num_accumulation_steps=2,
             jit_compile=True, clip_global_norm=0.5,
             noise_scale=noise_lib.NoiseScaleConfig(mode="plain")),
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01)),
    "fp16 skips, update in XLA": (
        dict(global_batch_size=16, precision="mixed_float16"),
        lambda: keras.optimizers.Adam(0.01)),
    "fp16 skips, --xla": (
        dict(global_batch_size=16, precision="mixed_float16",
             jit_compile=True),
        lambda: keras.optimizers.Adam(0.01)),
    "op by op": (
        dict(global_batch_size=16, compile_update=False),
        lambda: keras.optimizers.Adam(0.01)),
}

_STRATEGIES = {}


def strategy_on(device):
    if device not in _STRATEGIES:
        _STRATEGIES[device] = tf.distribute.MirroredStrategy([device])
    return _STRATEGIES[device]


def make_data(n=320):
    rng = np.random.RandomState(0)
    x = rng.randn(n, 6).astype("float32")
    y = np.tanh(x @ rng.randn(6, 2)).astype("float32")
    return x, y


def run_case(strategy, fields, optimizer_fn, steps=12):
    """(trainer, weights) after `steps` steps of a small model with dropout
    and layer norm."""
    policy = fields.get("precision", "float32")
    precision.set_precision(policy)
    try:
        keras.utils.set_random_seed(7)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                keras.layers.Dropout(0.1), keras.layers.LayerNormalization(),
                keras.layers.Dense(2)])
            optimizer = optimizer_fn()
            metrics = [keras.metrics.MeanAbsoluteError(name="mae")]
        trainer = Trainer(model=model, optimizer=optimizer,
                          loss_fn=keras.losses.MeanSquaredError(),
                          strategy=strategy, metrics=metrics,
                          config=TrainConfig(**dict(COMMON, **fields)))
        if trainer.loss_scale is not None:
            trainer.loss_scale.scale.assign(2.0 ** 40)  # overflows: skips
        x, y = make_data()

        def dataset_fn(context):
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
                trainer.per_replica_batch_size)

        trainer.fit(dataset_fn, steps_per_epoch=steps)
    finally:
        precision.set_precision("float32")
    return trainer, [v.numpy() for v in model.trainable_variables]


def test_the_gpu_device_takes_the_gpu_branch():
    assert gpu_branch.merge_call_in_compiled_replica_function_fails(
        strategy_on("/gpu:0"))
    assert not gpu_branch.merge_call_in_compiled_replica_function_fails(
        strategy_on("/cpu:0"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gpu_layout_ends_where_the_cpu_layout_ends(case):
    fields, optimizer_fn = CASES[case]
    cpu, cpu_weights = run_case(strategy_on("/cpu:0"), fields, optimizer_fn)
    gpu, gpu_weights = run_case(strategy_on("/gpu:0"), fields, optimizer_fn)
    assert int(gpu.step.numpy()) == int(cpu.step.numpy()) == 12
    assert int(gpu.optimizer.iterations.numpy()) == int(
        cpu.optimizer.iterations.numpy())
    if gpu.loss_scale is not None:
        skipped = 12 - int(gpu.optimizer.iterations.numpy())
        assert skipped > 1  # skips in fused calls too, not only timed steps
        assert float(gpu.loss_scale.scale.numpy()) == float(
            cpu.loss_scale.scale.numpy())
    for a, b in zip(cpu_weights, gpu_weights):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", ["fp16 skips, --xla",
                                  "lamb, --xla: one program per step",
                                  "sgd, update in XLA"])
def test_part_by_part_steps_on_the_gpu_layout_end_where_fused_ones_end(case):
    """Under the GPU layout, with dropout: a run whose steps 2 (untimed,
    it traces the part programs), 5 and 10 run part by part ends
    bit-identical to one whose steps all run inside calls."""
    fields, optimizer_fn = CASES[case]
    gpu = strategy_on("/gpu:0")
    split, split_weights = run_case(gpu, fields, optimizer_fn)
    fused, fused_weights = run_case(
        gpu, dict(fields, timed_steps_per_log=0), optimizer_fn)
    step = split._train_step
    assert step._sync_program.experimental_get_tracing_count() == 1
    assert step._split_steps == 3  # steps 2, 5 and 10
    assert fused._train_step._split_steps == 0
    for a, b in zip(split_weights, fused_weights):
        np.testing.assert_array_equal(a, b)


def test_one_replica_alone_runs_one_program_per_step():
    fields, optimizer_fn = CASES["lamb, --xla: one program per step"]
    trainer, _ = run_case(strategy_on("/gpu:0"), fields, optimizer_fn,
                          steps=3)
    layout = trainer._train_step.layout
    assert layout.fused and layout.alone
    assert layout.describe() == "one XLA program per step (compute, update)"


def test_the_default_update_is_compiled_on_the_gpu_layout_only():
    """`TrainConfig`'s default `compile_update` (auto): the update in XLA
    where the devices are GPUs (the GPU branch, taken here on a CPU), op
    by op on CPUs; both train. (Mutation tried: auto resolved to False
    everywhere fails the GPU half.)"""
    fields = dict(global_batch_size=16, verbose=0, steps_per_execution=3,
                  log_steps=5, timed_steps_per_log=1)
    layouts = {}
    for device in ("/gpu:0", "/cpu:0"):
        keras.utils.set_random_seed(7)
        strategy = strategy_on(device)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)),
                                      keras.layers.Dense(2)])
            optimizer = keras.optimizers.Adam(0.01)
        trainer = Trainer(model=model, optimizer=optimizer,
                          loss_fn=keras.losses.MeanSquaredError(),
                          strategy=strategy, config=TrainConfig(**fields))
        x, y = make_data()
        trainer.fit(lambda context: tf.data.Dataset.from_tensor_slices(
            (x, y)).repeat().batch(16), steps_per_epoch=6)
        assert int(trainer.step.numpy()) == 6
        assert all(np.isfinite(v.numpy()).all()
                   for v in model.trainable_variables)
        layouts[device] = trainer._train_step.layout
    assert layouts["/gpu:0"].update_xla
    assert layouts["/gpu:0"].describe().endswith("update in XLA")
    assert not layouts["/cpu:0"].update_xla
    assert layouts["/cpu:0"].describe().endswith("update op by op")


WORKER = os.path.join(os.path.dirname(__file__), "workers",
                      "gpu_layout_worker.py")


def test_single_worker_mwms_on_the_gpu_branch_ends_where_the_cpu_branch_ends(
        tmp_path):
    """A single-worker MultiWorkerMirroredStrategy (its own process: one
    per process), each case trained on the CPU branch and on the GPU
    branch."""
    code, output = run_command(
        [sys.executable, WORKER, "--out", str(tmp_path)], timeout=600)
    assert code == 0, output[-5000:]
    with open(tmp_path / "cases.json") as f:
        cases = json.load(f)
    assert cases["gpu_branch_taken"] is True
    assert sorted(cases["cases"]) == sorted(CASES)
    for case in CASES:
        cpu = np.load(tmp_path / f"{case}-cpu.npz")
        gpu = np.load(tmp_path / f"{case}-gpu.npz")
        assert len(cpu.files) == len(gpu.files) > 0
        for name in cpu.files:
            np.testing.assert_array_equal(cpu[name], gpu[name],
                                          err_msg=case)


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [True, False],
                         ids=["zero-1", "plain all-reduce"])
def test_two_workers_on_the_gpu_branch_end_where_the_cpu_branch_ends(
        tmp_path, sharded):
    """Two MWMS workers, LAMB with --xla, on the GPU branch: with ZeRO-1,
    the sharded sync and update (compiled pieces between the
    reduce-scatter, the norms' all-reduce and the all-gather); without
    it, the plain all-reduce of every gradient (the step a first
    multi-worker GPU run takes by default)."""
    results = {}
    for branch in ("cpu", "gpu"):
        out = tmp_path / branch
        out.mkdir()
        run_workers(2, ["tests.workers.train_worker", "--out", str(out),
                        "--optimizer", "lamb",
                        *(["--shard"] if sharded else []), "--xla",
                        "--steps", "8", "--steps_per_execution", "3",
                        *(["--gpu_branch"] if branch == "gpu" else [])])
        results[branch] = [np.load(out / f"weights_{i}.npz")
                           for i in range(2)]
    for worker in range(2):
        cpu, gpu = results["cpu"][worker], results["gpu"][worker]
        for name in cpu.files:
            np.testing.assert_array_equal(cpu[name], gpu[name])


def test_a_lone_one_gpu_bert_step_launches_few_kernels_outside_xla():
    """`benchmarks/gpu/step_kernels.py` on BERT-tiny: the default step of a
    one-GPU worker (XLA on) is one XLA program plus the loop's and the
    input's few ops; the update op by op adds thousands."""
    import argparse
    from benchmarks.gpu import step_kernels
    config = {"vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 64}
    args = argparse.Namespace(device="/gpu:0", steps_per_call=10)
    launches, reads = {}, {}
    for name in ("default", "uncompiled_update"):
        graph, _ = step_kernels.trace_layout(step_kernels.LAYOUTS[name],
                                             args, config)
        per_call, per_step = step_kernels.count_ops(graph)
        launches[name] = (per_step, sum(per_step.values())
                          + sum(per_call.values()) / args.steps_per_call)
        reads[name] = step_kernels.condition_reads(graph)
        if name == "default":
            # The call's step count, from the first step's flags, is set on
            # the host: one copy per call, none per step.
            limit = {op.type: op.device for op in graph.get_operations()
                     if op.type in ("Greater", "SelectV2")}
    per_step, total = launches["default"]
    assert per_step["XLA program"] == 1
    assert total <= 12
    assert launches["uncompiled_update"][1] > 100
    # The loop's condition reads the counter and the limit alone, no step's
    # output: the host queues step i + 1 while step i runs on the device
    # (docs/facts.md, fact 35).
    assert reads["default"] == ["int32", "int32"]
    assert reads["uncompiled_update"] == ["int32", "int32"]
    assert set(limit) == {"Greater", "SelectV2"}
    assert all("CPU" in device for device in limit.values()), limit
