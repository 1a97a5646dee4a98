"""The job skeleton (`tfscale.jobs.run`) with a task of one's own, and the
time-to-accuracy study's runs through it.

The BERT and image jobs are the same skeleton; their runs are in
test_bert_pretraining, test_pretraining, test_images and test_global_order.
"""

import dataclasses
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from planning import workload
from tfscale import jobs
from tfscale.cluster.environment import ClusterConfig
from tfscale.optim import OptimConfig
from tfscale.train_config import TrainConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig(jobs.JobConfig):
    examples: int = 256

    @property
    def evaluates(self) -> bool:
        return True


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


class Toy(jobs.Task):
    """Softmax regression on a fixed linear problem: a user's own task."""

    title = "toy_job"

    def __init__(self, config):
        super().__init__(config)
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(config.examples, 8)).astype(np.float32)
        self.y = (self.x @ rng.normal(size=(8,)) > 0).astype(np.int64)
        self.counter = CountBatches()

    def build(self):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)],
                                 name="toy")
        return jobs.Built(
            model, keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None),
            [keras.metrics.SparseCategoricalAccuracy(name="accuracy")])

    def dataset_fn(self, per_replica_batch, training):
        def make(context):
            ds = tf.data.Dataset.from_tensor_slices((self.x, self.y))
            if training:
                ds = ds.shuffle(len(self.y), seed=self.config.seed).repeat()
            return ds.batch(per_replica_batch, drop_remainder=True)
        return make

    def callbacks(self, trainer):
        return [self.counter]


def toy_config(tmp_path, steps=4, **overrides):
    out = str(tmp_path / "out")
    values = dict(
        optim=OptimConfig(optimizer="sgd", learning_rate=0.1,
                          schedule="constant", total_steps=steps),
        cluster=ClusterConfig(),
        train=TrainConfig(global_batch_size=16, num_accumulation_steps=2,
                          log_steps=2, save_checkpoints_steps=2,
                          checkpoint_dir=os.path.join(out, "checkpoints")),
        output_dir=out, eval_batch_size=32, max_eval_steps=4)
    values.update(overrides)
    return ToyConfig(**values)


def test_a_task_of_ones_own_trains_resumes_and_evaluates(tmp_path, capsys):
    toy = Toy(toy_config(tmp_path))
    results = jobs.run(toy)
    assert toy.counter.batches == 4  # the task's own callback ran
    assert results["steps"] == 4 and len(results["intervals"]) == 2
    assert results["checkpoint"].endswith("ckpt-4")
    assert results["noise_scale"] is not None  # 2 micro-batches per step
    assert 0 <= results["eval"]["accuracy"] <= 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval"] == results["eval"]
    # What tfscale-plan reads of it (docs/planning.md).
    facts = workload.from_summary(str(tmp_path / "out" / "summary.json"))
    assert (facts.workload.micro_batch, facts.workload.accumulation) == (8, 2)
    assert facts.workload.parameters == summary["parameters"] > 0
    assert facts.workload.micro_seconds > 0 and facts.steps == 4
    assert facts.noise_scale == summary["noise_scale"]["b_simple"]
    printed = capsys.readouterr().out
    assert printed.startswith("toy_job\n  workers 1 (single), replicas 1, "
                              "global batch 16 = 8 per replica x 1 x 2 "
                              "accumulation\n  placement: 1 replica on "
                              "CPU:0, variables on CPU:0 (worker 0 sees no "
                              "GPU)\n"), printed
    assert "  model toy: 0.00M parameters" in printed
    assert "optimizer sgd, lr 0.1 (constant, warmup 0, scaling none), 4 " \
        "steps" in printed
    assert "toy_job done\n  steps 4" in printed

    # Longer: resumes at step 4 and trains 2 more, saying the schedule
    # grew.
    longer = Toy(toy_config(tmp_path, steps=6))
    assert jobs.run(longer)["steps"] == 6 and longer.counter.batches == 2
    said = capsys.readouterr().out
    assert ("the checkpoint's run: global batch 16, learning rate 0.1, "
            "schedule steps 4; this run: global batch 16, learning rate 0.1, "
            "schedule steps 6") in said, said
    # Evaluating only: the latest checkpoint's weights and step.
    again = jobs.run(Toy(toy_config(tmp_path, steps=6, do_train=False)))
    assert again["steps"] == 6 and again["checkpoint"].endswith("ckpt-6")


class ToyWithItsOwnOptimizer(Toy):
    def build(self):
        built = Toy.build(self)
        self.model = built.model
        self.initial = [w.numpy().copy() for w in built.model.weights]
        return built._replace(optimizer=keras.optimizers.SGD(0.0))


def test_a_task_s_own_optimizer_is_used_and_named(tmp_path, capsys):
    toy = ToyWithItsOwnOptimizer(toy_config(tmp_path, steps=2))
    assert jobs.run(toy)["steps"] == 2
    printed = capsys.readouterr().out
    assert "  optimizer SGD (the task's own), 2 steps" in printed, printed
    # Learning rate 0: the task's optimizer ran, not the config's (0.1).
    for before, after in zip(toy.initial, toy.model.weights):
        np.testing.assert_array_equal(before, after.numpy())


def test_evaluating_only_without_a_checkpoint_names_the_flag(tmp_path):
    with pytest.raises(jobs.JobError, match=r"^--do_train: evaluating only "
                       r"needs a checkpoint in --output_dir: no checkpoint"):
        jobs.run(Toy(toy_config(tmp_path, do_train=False)))


def test_a_job_whose_variables_miss_the_gpu_it_sees_stops_in_one_line(
        tmp_path, monkeypatch):
    """A worker that sees a GPU (listed as CUDA would) but whose variables
    land on the CPU (soft placement on this CPU machine) stops before its
    first step with a line naming the variable; not restartable."""
    fake = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    listed = tf.config.get_visible_devices
    monkeypatch.setattr(tf.config, "get_visible_devices",
                        lambda kind=None: [fake] if kind == "GPU"
                        else listed(kind))
    configured = tf.config.get_logical_device_configuration
    monkeypatch.setattr(tf.config, "get_logical_device_configuration",
                        lambda d: None if d == fake else configured(d))
    config = toy_config(tmp_path)
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, jit_compile=False, compile_update=False))
    with pytest.raises(jobs.JobError) as raised:
        jobs.run(Toy(config))
    assert raised.value.restartable is False
    assert raised.value.line().startswith(
        "worker 0 sees 1 GPU (GPU:0) and its replicas are on GPU:0, but "
        "variable toy/dense")
    assert not os.path.exists(os.path.join(config.output_dir, "summary.json"))


def test_the_config_names_the_field_at_fault(tmp_path):
    with pytest.raises(ValueError, match="total_steps must be >= 1"):
        toy_config(tmp_path, steps=0)
    with pytest.raises(ValueError, match="profile_steps must be"):
        toy_config(tmp_path, profile_steps=(3, 2))
    with pytest.raises(TypeError):  # keyword-only: no silent reordering
        ToyConfig(OptimConfig(), ClusterConfig(), TrainConfig(), "out")


FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(FASHION),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_the_study_runs_through_the_skeleton():
    from benchmarks.time_to_accuracy import study as time_to_accuracy
    from benchmarks.time_to_accuracy import tasks
    study = tasks.fashion_task(FASHION, target=0.7)
    result = time_to_accuracy.run_one(study, "sgd", 256, 0.05, seed=1)
    # One seed, one run: the same steps and noise scale, to the bit.
    assert result["reached"] and result["steps"] == result["steps_run"]
    again = time_to_accuracy.run_one(study, "sgd", 256, 0.05, seed=1)
    assert (again["steps"], again["b_simple"]) == (result["steps"],
                                                   result["b_simple"])
    assert result["b_simple"] > 0


def test_a_study_is_keyed_by_everything_that_defines_it(tmp_path,
                                                        monkeypatch):
    """Editing any part of a study's definition gives it a new digest (so
    its runs go to a new file and old ones are never reused); reading the
    same bytes from another folder does not."""
    from benchmarks.time_to_accuracy import study as tta

    def build_model():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

    def build_model_edited():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    def dataset_fn(per_replica_batch, seed):
        return per_replica_batch

    def dataset_fn_edited(per_replica_batch, seed):
        return per_replica_batch * 2

    def evaluate(model):
        return 0.0

    def evaluate_edited(model):
        return 1.0

    for path in ("models/mlp.py",):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("# code\n")
    monkeypatch.setattr(tta, "ROOT", str(tmp_path))
    base = tta.Study(
        name="toy", batches=(16, 64), reference_batch=16,
        base_rates={"sgd": 0.1}, target=0.8, higher_is_better=True,
        metric="accuracy", cap_examples=1000, warmup_examples=10,
        build_model=build_model, loss_fn=keras.losses.MeanSquaredError(),
        dataset_fn=dataset_fn, evaluate=evaluate,
        data={"fingerprint": "a" * 64, "files": ["x"]}, model="MLP",
        source="/data/here", code_files=("models/mlp.py",))
    digests = {"base": base.digest()}
    for name, change in (
            ("data content", {"data": {"fingerprint": "b" * 64,
                                       "files": ["x"]}}),
            ("target", {"target": 0.81}),
            ("model in words", {"model": "MLP, wider"}),
            ("model code", {"build_model": build_model_edited}),
            ("loss", {"loss_fn": keras.losses.MeanAbsoluteError()}),
            ("data pipeline code", {"dataset_fn": dataset_fn_edited}),
            ("evaluation code", {"evaluate": evaluate_edited}),
            ("rates", {"base_rates": {"sgd": 0.2}}),
            ("batches", {"batches": (16, 64, 256)}),
            ("warmup", {"warmup_examples": 20})):
        digests[name] = dataclasses.replace(base, **change).digest()
    for name, attribute, value in (
            ("rate grid", "RATE_STEPS", (1 / 2, 1.0, 2.0)),
            ("give up", "GIVE_UP", 4), ("seeds", "SEEDS", (1, 3)),
            ("window", "WINDOW_EXAMPLES", 12_800),
            ("optimizer settings", "optimizer_settings",
             lambda o: {"optimizer": o, "weight_decay": 0.0})):
        with monkeypatch.context() as patch:
            patch.setattr(tta, attribute, value)
            digests[name] = base.digest()
    for path in ("models/mlp.py",):
        (tmp_path / path).write_text("# code, edited\n")
        digests[f"file {path}"] = base.digest()
    # The engine's numbers: the noise scale's per-step estimates, the
    # optimizers' rates.
    from tfscale.noise import scale as noise_scale
    from tfscale.optim import factory
    steps = noise_scale.step_estimates
    rates = factory.scale_learning_rate
    for name, module, attribute, value in (
            ("estimator numbers", noise_scale, "step_estimates",
             lambda *a: tuple(1.001 * v for v in steps(*a))),
            ("optimizer numbers", factory, "scale_learning_rate",
             lambda *a: 1.001 * rates(*a))):
        with monkeypatch.context() as patch:
            patch.setattr(module, attribute, value)
            tta.engine_digests.cache_clear()
            digests[name] = base.digest()
    tta.engine_digests.cache_clear()
    assert len(set(digests.values())) == len(digests), digests
    moved = dataclasses.replace(base, source="/data/elsewhere")
    assert moved.digest() == digests["file models/mlp.py"]
    assert "/data/elsewhere" in moved.data_label


def test_idx_files_read_and_a_bad_one_is_named(tmp_path):
    from input_pipelines import idx
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big")
                     + bytes([7, 0, 9]))
    assert idx.read_idx(str(path)).tolist() == [7, 0, 9]
    path.write_bytes(bytes([0, 0, 8, 1]) + (4).to_bytes(4, "big")
                     + bytes([7, 0, 9]))
    with pytest.raises(idx.IdxError, match=f"^{path}: 11 bytes, but its "
                       r"header says \[4\]"):
        idx.read_idx(str(path))
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        idx.load_fashion_mnist(str(tmp_path), "test")
    if os.path.isdir(FASHION):
        images, labels = idx.load_fashion_mnist(FASHION, "test")
        assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
        assert sorted(set(labels.tolist())) == list(range(10))


def test_a_refactor_of_the_engine_keeps_a_studys_digest(monkeypatch):
    """The estimator and optimizers count by their outputs: the same
    numbers from other code (a function rewritten, moved, renamed) keep a
    study's digest, and its results with it."""
    from benchmarks.time_to_accuracy import study as tta
    from tfscale.noise import scale as noise_scale
    tta.engine_digests.cache_clear()
    before = tta.engine_digests()
    original = noise_scale.step_estimates

    def rewritten(small_sum, count, big, global_batch_size):
        estimates = original(small_sum, count, big, global_batch_size)
        return estimates[0], estimates[1]

    monkeypatch.setattr(noise_scale, "step_estimates", rewritten)
    monkeypatch.setattr(noise_scale, "fieller",
                        lambda *args, _f=noise_scale.fieller: _f(*args))
    tta.engine_digests.cache_clear()
    assert tta.engine_digests() == before
    tta.engine_digests.cache_clear()
