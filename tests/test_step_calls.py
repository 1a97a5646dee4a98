"""Several optimizer steps per call of the compiled step
(`TrainConfig.steps_per_execution`) and the XLA-compiled update, in one
process under MirroredStrategy on logical CPUs.

The invariant: a run that calls the device once per n steps ends where a run
of one step per call ends, whatever the precision, accumulation, noise
scale, checkpoints or resume; and the host reads the device once per call.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops  # to count host reads

from tfscale.noise import scale as noise_lib
from tfscale import precision
from tfscale.step.feed import InputPipelineError
from tfscale.optim.lamb import Lamb
from tfscale.trainer.loop import TrainConfig, Trainer
from tests.test_trainer import (TWO_CPUS, Recorder, build, data,
                                dataset_fn_for, make_trainer, mirrored,
                                weights)


def train(config, optimizer_fn=lambda: keras.optimizers.SGD(0.05),
          devices=TWO_CPUS, steps=12, epochs=1, callbacks=(), x=None, y=None):
    trainer = make_trainer(mirrored(devices), config, optimizer_fn)
    if x is None:
        x, y = data()
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=steps,
                epochs=epochs, callbacks=list(callbacks))
    return trainer


CASES = {
    "sgd": (dict(global_batch_size=16), lambda: keras.optimizers.SGD(0.05)),
    "adam, 2 micro-batches, clipping": (
        dict(global_batch_size=32, num_accumulation_steps=2,
             clip_global_norm=0.5), lambda: keras.optimizers.Adam(0.01)),
    "lamb, noise scale": (
        dict(global_batch_size=16,
             noise_scale=noise_lib.NoiseScaleConfig(mode="plain")),
        lambda: Lamb(0.01, weight_decay_rate=0.01)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_several_steps_per_call_end_where_one_step_per_call_ends(case):
    fields, optimizer_fn = CASES[case]
    runs = []
    for per_call in (1, 4):
        recorder = Recorder()
        trainer = train(TrainConfig(
            **fields, log_steps=5, timed_steps_per_log=1, verbose=0,
            steps_per_execution=per_call), optimizer_fn, steps=12,
            callbacks=[recorder])
        runs.append((trainer, trainer.intervals, recorder.batch_logs[-1]))
    (one, one_reports, one_last), (four, four_reports, four_last) = runs
    assert int(four.step.numpy()) == int(one.step.numpy()) == 12
    for a, b in zip(weights(one.model), weights(four.model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Reports at the same steps (5, 10, 12) with the same losses.
    assert [r["step"] for r in one_reports] == [5, 10, 12]
    assert [r["step"] for r in four_reports] == [5, 10, 12]
    for a, b in zip(one_reports, four_reports):
        assert b["interval_loss"] == pytest.approx(a["interval_loss"],
                                                   rel=1e-6)
        if "gradient_noise_scale" in a:
            assert b["gradient_noise_scale"] == pytest.approx(
                a["gradient_noise_scale"], rel=1e-5)
    assert four_last["mae"] == pytest.approx(one_last["mae"], rel=1e-5)


def test_float16_skips_on_the_device_as_the_host_did():
    precision.set_precision("mixed_float16")
    try:
        runs = []
        for per_call in (1, 8):
            trainer = make_trainer(mirrored(TWO_CPUS), TrainConfig(
                global_batch_size=16, precision="mixed_float16", verbose=0,
                log_steps=8, timed_steps_per_log=1,
                steps_per_execution=per_call))
            trainer.loss_scale.scale.assign(2.0 ** 40)  # overflows float16
            x, y = data()
            trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=24)
            runs.append(trainer)
    finally:
        precision.set_precision("float32")
    one, eight = runs
    skipped = int(one.step.numpy()) - int(one.optimizer.iterations.numpy())
    assert skipped > 1  # more than the timed steps could skip
    assert all(np.all(np.isfinite(w)) for w in weights(eight.model))
    assert int(eight.optimizer.iterations.numpy()) == int(
        one.optimizer.iterations.numpy())
    assert float(eight.loss_scale.scale.numpy()) == float(
        one.loss_scale.scale.numpy())
    for a, b in zip(weights(one.model), weights(eight.model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class HostReads:
    """Counts values copied from tensors to Python (`.numpy()`, `float()`,
    `bool()`, `int()` all go through `_numpy`)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = tf_ops._EagerTensorBase._numpy

        def counted(tensor):
            self.count += 1
            return original(tensor)
        monkeypatch.setattr(tf_ops._EagerTensorBase, "_numpy", counted)


@pytest.mark.parametrize("per_call", [20, 1])
def test_the_host_reads_the_device_once_per_call(monkeypatch, per_call):
    # (Calls of exactly per_call steps: no wall-time bound.)
    config = TrainConfig(global_batch_size=16, log_steps=20,
                         timed_steps_per_log=0, verbose=0,
                         steps_per_execution=per_call, max_call_seconds=0)
    trainer = train(config, steps=20)  # traced and warm
    reads = HostReads(monkeypatch)
    x, y = data()
    # 180 more steps: 9 calls of 20 steps, 9 reports, 2 epoch ends.
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=100, epochs=2)
    per_step = reads.count / 180
    if per_call == 20:
        # Per call: its rows (loss, flags, noise sums, fp16 skips) and the
        # metrics; per report the learning rate; a few per epoch.
        assert per_step < 0.25
    else:  # one step per call: the rows and the metrics of every step
        assert per_step >= 2


def test_a_stop_raised_in_a_callback_ends_training_after_that_call():
    # One worker acts on its own flag at once, as Keras's fit does; with
    # several workers the flag rides in the next step's all-reduce and the
    # call ends after that step (tests/test_multiworker.py).
    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 7:  # the end of the second call (steps 5-8)
                self.model.stop_training = True

    # (Calls of exactly 4 steps: no wall-time bound.)
    trainer = train(TrainConfig(global_batch_size=16, log_steps=100,
                                timed_steps_per_log=0, verbose=0,
                                steps_per_execution=4, max_call_seconds=0),
                    steps=40, callbacks=[StopAt()])
    assert int(trainer.step.numpy()) == 8


def test_resume_with_several_steps_per_call_ends_where_it_would(tmp_path):
    config = dict(global_batch_size=16, save_checkpoints_steps=3,
                  log_steps=5, timed_steps_per_log=1, steps_per_execution=4,
                  verbose=0)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    full = train(TrainConfig(checkpoint_dir=str(tmp_path / "full"), **config),
                 adam, steps=7, epochs=2)

    class StopAfterStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) >= 4:
                self.model.stop_training = True

    split = TrainConfig(checkpoint_dir=str(tmp_path / "split"), **config)
    first = train(split, adam, steps=7, epochs=2,
                  callbacks=[StopAfterStep()])
    assert 4 <= int(first.step.numpy()) < 14
    second = train(split, adam, steps=7, epochs=2)
    assert int(second.step.numpy()) == 14
    for a, b in zip(weights(full.model), weights(second.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


UPDATES = pytest.mark.parametrize("optimizer_fn", [
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
    lambda: Lamb(0.01, weight_decay_rate=0.01)], ids=["adamw", "lamb"])


def compiled_against_plain(optimizer_fn, compiled: dict, **config):
    """Weights after 6 steps on one replica, op by op and with `compiled`
    (TrainConfig fields), each checked to have compiled its update or not."""
    results = []
    for fields in ({key: False for key in compiled}, compiled):
        trainer = train(TrainConfig(global_batch_size=16, verbose=0,
                                    steps_per_execution=3, **fields,
                                    **config),
                        optimizer_fn, devices=["/cpu:0"], steps=6)
        assert trainer._train_step.layout.update_xla == any(fields.values())
        results.append(weights(trainer.model))
    return results


@UPDATES
def test_the_compiled_update_matches_the_plain_one(optimizer_fn):
    """Without --xla the update and the work after the all-reduce are
    XLA-compiled (one replica per worker): the same weights as
    TensorFlow's op-by-op update, to float32 rounding, with clipping."""
    plain, compiled = compiled_against_plain(
        optimizer_fn, {"compile_update": True}, clip_global_norm=0.5)
    for a, b in zip(plain, compiled):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@UPDATES
def test_the_xla_update_matches_the_plain_one(optimizer_fn):
    plain, compiled = compiled_against_plain(
        optimizer_fn, {"jit_compile": True, "compile_update": True})
    for a, b in zip(plain, compiled):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_update_is_not_compiled_over_several_local_replicas():
    trainer = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        global_batch_size=16, jit_compile=True))
    assert not trainer._train_step.layout.update_xla


def test_an_input_error_inside_a_call_is_an_input_error():
    x, y = data(n=64)
    trainer = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        global_batch_size=16, verbose=0, steps_per_execution=8,
        timed_steps_per_log=0))

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).enumerate()
        ds = ds.map(lambda i, xy: (tf.debugging.assert_less(
            i, tf.constant(40, tf.int64), message="bad record 40"), xy)[1])
        return ds.batch(trainer.per_replica_batch_size)

    with pytest.raises(InputPipelineError, match="bad record 40"):
        trainer.fit(dataset_fn, steps_per_epoch=8)


def test_steps_per_execution_must_be_positive():
    with pytest.raises(ValueError, match="steps_per_execution"):
        TrainConfig(global_batch_size=16, steps_per_execution=0)


@pytest.mark.parametrize("timed, per_call", [(1, 4), (0, 5)],
                         ids=["calls 1-4, 5, 6-9, 10, 11-12",
                              "calls 1-5, 6-10, 11-12"])
def test_tensorboard_counts_optimizer_steps_not_calls(tmp_path, timed,
                                                      per_call):
    """Keras's batch logs at the steps that are multiples of update_freq,
    whichever step a call starts from; the Trainer's interval numbers at
    every interval's end, the epoch's last, short one too. (With calls of
    5 steps, Keras 3.15's TensorBoard alone recorded none.)"""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator)
    board = keras.callbacks.TensorBoard(str(tmp_path), update_freq=5)
    train(TrainConfig(global_batch_size=16, log_steps=5,
                      timed_steps_per_log=timed, steps_per_execution=per_call,
                      max_call_seconds=0, verbose=0),
          steps=12, callbacks=[board])
    events = EventAccumulator(str(tmp_path / "train"))
    events.Reload()
    assert [e.step for e in events.Tensors("batch_loss")] == [5, 10]
    assert [e.step for e in events.Tensors(
        "batch_interval_loss")] == [5, 10, 12]


def test_the_noise_norms_are_compiled_under_op_determinism():
    """Under --deterministic the per-micro-batch squared norms run in XLA,
    whose sums do not depend on the intra-op thread count (TensorFlow's
    CPU kernels' do: a bare mpirun runs one thread a rank); elsewhere they
    stay TensorFlow's (about 5% of a CPU step cheaper). (Mutation tried:
    never compiled.)"""
    tf.config.experimental.enable_op_determinism()
    try:
        step = make_trainer(mirrored(TWO_CPUS), TrainConfig(
            global_batch_size=16))._train_step
        assert step.measures_noise
        assert getattr(step.replica._squared_norms, "_jit_compile", None) is True
    finally:
        from tensorflow.python.framework import config
        config.disable_op_determinism()
    step = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        global_batch_size=16))._train_step
    assert not getattr(step.replica._squared_norms, "_jit_compile", False)


def test_the_plan_is_the_step_number_and_four_settings():
    """`StepPlan` needs no TensorFlow object: a namespace with the four
    settings plans. Timed steps run alone; calls end at log and checkpoint
    boundaries, whatever step they start from."""
    import types
    from tfscale.step.plan import StepPlan
    plan = StepPlan(types.SimpleNamespace(
        log_steps=10, timed_steps_per_log=2, steps_per_execution=4,
        save_checkpoints_steps=6))
    assert [s for s in range(1, 21) if plan.is_timed(s)] == [9, 10, 19, 20]
    calls, step = [], 1
    while step <= 20:
        n = plan.steps_in_call(step, most=20 - step + 1)
        calls.append((step, n))
        step += n
    # Step 2 alone: it traces the part programs (the next test).
    assert calls == [(1, 1), (2, 1), (3, 4), (7, 2), (9, 1), (10, 1),
                     (11, 2), (13, 4), (17, 2), (19, 1), (20, 1)]
    # From any step, the same calls as an uninterrupted run.
    assert plan.steps_in_call(13, 20) == 4 and plan.steps_in_call(7, 1) == 1


def test_step_2_runs_part_by_part_when_the_epoch_reaches_a_timed_step():
    """The first part-by-part step traces the part programs: when the first
    epoch reaches a timed step, that happens at step 2 (untimed), beside
    the first call's tracing; a shorter epoch never traces them."""
    import types
    from tfscale.step.plan import StepPlan
    config = types.SimpleNamespace(
        log_steps=100, timed_steps_per_log=4, steps_per_execution=8,
        save_checkpoints_steps=0)
    plan = StepPlan(config)

    def calls(steps):
        out, step = [], 1
        while step <= steps:
            n = plan.steps_in_call(step, most=steps - step + 1)
            out.append((step, n, plan.part_by_part(step, steps - step + 1)))
            step += n
        return out
    long_run = calls(120)
    assert long_run[:3] == [(1, 1, False), (2, 1, True), (3, 8, False)]
    assert [s for s, _, split in long_run if split] == [2, 97, 98, 99, 100]
    assert not plan.is_timed(2)  # runs part by part, not counted
    # The epoch ends before step 97: nothing runs part by part.
    assert all(not split for _, _, split in calls(96))
    assert calls(97)[1] == (2, 1, True)
    config.timed_steps_per_log = 0
    assert all(not split for _, _, split in calls(120))


# The layouts the warm-up step meets: two replicas, and one replica alone
# on a CPU and on a GPU (`MirroredStrategy(["/gpu:0"])` on this CPU takes
# tf.distribute's GPU branch, `tests/test_gpu_layout.py`), there with the
# GPU's defaults: XLA on, the update compiled.
WARM_UP_LAYOUTS = {
    "two cpus": (TWO_CPUS, {}),
    "/cpu:0": (["/cpu:0"], {}),
    "/gpu:0, xla": (["/gpu:0"], dict(jit_compile=True, compile_update=True)),
}


@pytest.mark.parametrize("layout", sorted(WARM_UP_LAYOUTS))
@pytest.mark.parametrize("steps,traced_at_step_2", [(10, True), (8, False)])
def test_the_part_programs_trace_at_step_2_or_never(layout, steps,
                                                    traced_at_step_2):
    """A Trainer whose epoch reaches a timed step (steps 9, 10) runs step 2
    part by part: the programs only part-by-part steps call (the sync
    program) are traced there, not inside its first log interval; one whose
    epoch ends before never traces them. Under every layout the run ends
    bit-identical to one with no part-by-part step at all."""
    devices, fields = WARM_UP_LAYOUTS[layout]
    traces = {}

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            program = self.trainer._train_step._sync_program
            traces[batch + 1] = program.experimental_get_tracing_count()

    def run(timed, callbacks=()):
        keras.utils.set_random_seed(3)
        trainer = make_trainer(mirrored(devices), TrainConfig(
            global_batch_size=16, log_steps=10, timed_steps_per_log=timed,
            verbose=0, **fields))
        for callback in callbacks:
            callback.trainer = trainer
        x, y = data()
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=steps,
                    callbacks=list(callbacks))
        return trainer
    trainer = run(2, [Count()])
    assert traces[1] == 0
    assert traces[2] == (1 if traced_at_step_2 else 0)
    assert traces[steps] == traces[2]  # never traced again
    assert int(trainer.step.numpy()) == steps
    untimed = run(0)
    assert untimed._train_step._sync_program.experimental_get_tracing_count() == 0
    for a, b in zip(weights(untimed.model), weights(trainer.model)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", sorted(CASES) + ["/gpu:0, xla, float16"])
def test_the_step_is_traced_without_autograph(monkeypatch, case):
    """As Keras 3's fit traces its step: no function of the step (ours, or
    the model's, loss's and metrics' it calls) goes through AutoGraph's
    conversion, under two replicas and under the GPU layout with XLA."""
    from tensorflow.python.autograph.impl import api as autograph
    converted = []
    convert = autograph._convert_actual

    def recording(entity, program_ctx):
        converted.append(getattr(entity, "__qualname__", repr(entity)))
        return convert(entity, program_ctx)
    monkeypatch.setattr(autograph, "_convert_actual", recording)
    if case in CASES:
        fields, optimizer_fn = CASES[case]
        devices = TWO_CPUS
    else:
        precision.set_precision("mixed_float16")
        fields = dict(global_batch_size=16, precision="mixed_float16",
                      jit_compile=True, compile_update=True)
        optimizer_fn, devices = lambda: keras.optimizers.SGD(0.05), ["/gpu:0"]
    try:
        trainer = train(TrainConfig(**fields, log_steps=5,
                                    timed_steps_per_log=2, verbose=0),
                        optimizer_fn, devices=devices, steps=6)
    finally:
        precision.set_precision("float32")
    assert int(trainer.step.numpy()) == 6
    # The input pipeline's functions are tf.data's to convert (a user's
    # parse function may rely on it); none of the step's is.
    assert [name for name in converted if "dataset_fn" not in name] == []


def test_python_control_flow_on_tensors_fails_in_fit_and_the_trainer_alike():
    """docs/trainer.md's promise: what Keras 3's fit cannot trace (a metric
    branching in Python on a tensor), the Trainer cannot either, with the
    same error; and the same metric written with `keras.ops.where` trains
    under both."""
    class Branching(keras.metrics.Mean):
        def update_state(self, y_true, y_pred, sample_weight=None):
            error = keras.ops.mean(keras.ops.abs(y_true - y_pred))
            if error > 1e9:  # Python control flow on a tensor
                error = error * 0.0
            return super().update_state(error)

    class Branchless(keras.metrics.Mean):
        def update_state(self, y_true, y_pred, sample_weight=None):
            error = keras.ops.mean(keras.ops.abs(y_true - y_pred))
            return super().update_state(
                keras.ops.where(error > 1e9, error * 0.0, error))

    x, y = data()
    strategy = mirrored(TWO_CPUS)
    for metric, fails in ((Branching, True), (Branchless, False)):
        outcomes = []
        model, _, _ = build(strategy)
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=[metric()])
        trainer = Trainer(model=build(strategy)[0],
                          optimizer=keras.optimizers.SGD(0.05),
                          loss_fn=keras.losses.MeanSquaredError(),
                          strategy=strategy, metrics=[metric()],
                          config=TrainConfig(global_batch_size=16, verbose=0))
        for run in (lambda: model.fit(x, y, batch_size=16, steps_per_epoch=2,
                                      verbose=0),
                    lambda: trainer.fit(dataset_fn_for(trainer, x, y),
                                        steps_per_epoch=2)):
            try:
                run()
                outcomes.append(None)
            except tf.errors.OperatorNotAllowedInGraphError as e:
                outcomes.append("as a Python `bool`" in str(e))
        assert outcomes == ([True, True] if fails else [None, None])


LOOP_LAYOUTS = {
    "one replica": (["/cpu:0"], {}),
    "two replicas": (TWO_CPUS, {}),
    # tf.distribute's GPU branch on this CPU (tests/gpu_branch.py), the
    # step one XLA program as on a one-GPU worker.
    "/gpu:0, xla": (["/gpu:0"], dict(jit_compile=True, compile_update=True)),
}


@pytest.mark.parametrize("layout", sorted(LOOP_LAYOUTS))
def test_the_loop_reads_no_step_output_to_go_on(layout):
    # The flags that end a call early hold for the whole call: the first
    # step's set the call's limit, and the loop's condition is the counter
    # and that limit (int32, kept on the host), so on a GPU the host queues
    # step i + 1 while step i runs (docs/facts.md, fact 35). Several
    # workers stop a call at the same step: tests/test_multiworker.py.
    from benchmarks.gpu import step_kernels
    from tfscale.step.feed import ReplicaFeed
    from tfscale.trainer import parts as trainer_parts
    from tfscale.trainer.timing import StepTimer
    devices, fields = LOOP_LAYOUTS[layout]
    trainer = train(TrainConfig(global_batch_size=16, log_steps=100,
                                timed_steps_per_log=0, verbose=0,
                                steps_per_execution=4, **fields),
                    devices=devices, steps=4)
    x, y = data()
    feed = ReplicaFeed(trainer.strategy, dataset_fn_for(trainer, x, y),
                       num_replicas=len(devices), num_workers=1,
                       worker_index=0)
    trainer._replica_feed = feed  # what fit sets: the call reads it
    step = trainer._train_step
    assert step.layout.fused == (layout == "/gpu:0, xla")
    with trainer_parts.borrowed(trainer.model, trainer.optimizer):
        graph = step.call_graph(feed.iterator, 4)
        assert step_kernels.condition_reads(graph) == ["int32", "int32"]
        # The limit from the first step's flags: a raised stop or preempt
        # flag ends the call after its first step, none lets it run whole.
        timer = StepTimer(16)
        runs = {flags: step.run(5, 4, feed.iterator, list(flags), timer)
                for flags in ((0.0, 0.0, 0.0), (1.0, 0.0, 0.0),
                              (0.0, 1.0, 0.0))}
    assert runs[(0.0, 0.0, 0.0)].steps == 4
    assert not runs[(0.0, 0.0, 0.0)].stop and not runs[(0.0, 0.0, 0.0)].preempt
    assert runs[(1.0, 0.0, 0.0)].steps == 1 and runs[(1.0, 0.0, 0.0)].stop
    assert runs[(0.0, 1.0, 0.0)].steps == 1 and runs[(0.0, 1.0, 0.0)].preempt


def test_the_pace_proposes_what_fits_the_bound_and_agrees_on_the_sum():
    from tfscale.step.pace import CallPace
    chief = CallPace(2.0, local_replicas=2, is_chief=True)
    other = CallPace(2.0, local_replicas=2, is_chief=False)
    # Until a proposal came back, one step per call (the first compiles).
    assert chief.proposal() == 0.0 and chief.steps(1000) == 1
    chief.observe(steps=10, seconds=0.5)  # 50 ms a step: 40 fit in 2 s,
    assert chief.proposal() == 20.0  # at most twice the measured call's
    chief.observe(steps=20, seconds=1.0)
    other.observe(steps=20, seconds=0.1)
    assert chief.proposal() == 40.0 and other.proposal() == 0.0
    # The sum over the chief's 2 replicas, the others' zeros: every worker
    # reads the same number and sizes its calls alike.
    for pace in (chief, other):
        pace.agree(2 * 40.0)
        assert pace.steps(1000) == 40 and pace.steps(7) == 7
    slow = CallPace(2.0, local_replicas=1, is_chief=True)
    slow.observe(steps=1, seconds=30.0)  # a step longer than the bound
    assert slow.proposal() == 1.0
    unbounded = CallPace(None, local_replicas=1, is_chief=True)
    unbounded.observe(steps=10, seconds=0.5)
    assert unbounded.proposal() == 0.0 and unbounded.steps(1000) == 1000


def slow_dataset_fn(trainer, x, y, seconds):
    """`dataset_fn_for`'s batches, each `seconds` late: a step of known
    length whatever the machine."""
    from tensorflow.python.data.experimental.ops import testing
    plain = dataset_fn_for(trainer, x, y)
    return lambda context: plain(context).apply(
        testing.sleep(int(seconds * 1e6)))


@pytest.mark.parametrize("layout", sorted(LOOP_LAYOUTS))
def test_a_call_ends_within_its_time_bound_at_any_steps_per_execution(
        layout):
    # 1,000 steps per call, Google's iterations_per_loop, and steps of at
    # least 20 ms: calls of about 0.2 s, ~10 steps, after the first two
    # (one step each: no pace agreed yet) and a few that grow (each at
    # most twice a measured one). Without the bound (the mutation) the
    # epoch's 60 steps are one or two calls.
    devices, fields = LOOP_LAYOUTS[layout]

    class CallEnds(keras.callbacks.Callback):
        ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(batch + 1)

    recorder = CallEnds()
    trainer = make_trainer(mirrored(devices), TrainConfig(
        global_batch_size=16, log_steps=1000, timed_steps_per_log=0,
        verbose=0, steps_per_execution=1000, max_call_seconds=0.2,
        **fields))
    x, y = data()
    trainer.fit(slow_dataset_fn(trainer, x, y, 0.02), steps_per_epoch=60,
                callbacks=[recorder])
    ends = recorder.ends
    calls = [b - a for a, b in zip([0] + ends, ends)]
    assert sum(calls) == 60 and calls[:2] == [1, 1], calls
    assert max(calls) <= 20, calls
    assert len(calls) >= 8, calls
