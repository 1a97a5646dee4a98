"""The distributed training step: compute, sync, update; several per call.

One optimizer step is three parts (`step/replica.py` holds their math):

    compute  per replica: forward and backward over k micro-batches, the
             gradients summed locally and the metrics updated.
    sync     one all-reduce of [loss and flags, *gradients] across all
             replicas (through the backend's `collectives.py` object), then
             loss-scale removal, the finite check and clipping; sharded
             (`sharded_sync.py`), a reduce-scatter in its place.
    update   the optimizer's update with the reduced gradients; fp16 skips
             it when they are not all finite (the same decision everywhere).

Where XLA sits (`Layout`; fact 30). Keras 3 compiles around `strategy.run`, never
inside it, and so does this step wherever a worker holds one replica (one
GPU per process, the layout of MWMS, MPI and most GPU jobs): on GPUs,
`strategy.run` traces a function it is handed that is itself compiled in
each replica's own graph, where the `merge_call` of Keras's update (its
`iterations` counter) raises; a CPU run takes another path and never sees
it (`MirroredStrategy(["/gpu:0"])` on a CPU takes the GPU path: the tests
do). So per step, with one replica:

    alone (one replica in the job)  one XLA program: compute, the reduced
        part (no all-reduce of one term) and the update, the fp16 skip a
        conditional inside it (`--noxla`: the compute op by op, then one
        program for the rest);
    one of several workers          two programs, the all-reduce between
        them outside XLA (XLA compiles no collective on CPU; MPI's runs on
        the host).

With several replicas in one process (`MirroredStrategy` over local
devices) XLA cannot compile around `strategy.run` (the replicas' variables
sit on different devices): the compute and the after-reduce work are
compiled inside it, as functions without a `merge_call`, and the update
runs op by op.

`run` is the loop's one entry point. A call runs up to n whole steps
(Keras's `steps_per_execution`, bounded in wall time by `pace.py`), reading
the input inside it; every step's loss, flags and noise sums come back in
one tensor. It leaves at the first step whose all-reduced flags ask to
stop or save, on every worker alike; the flags hold for a whole call, so
the first step's set the call's length and the loop reads nothing back
after it. Every step's batch is checked (a compare of the batch dimension,
on the host's copy of the shape). The last steps of each log interval run
part by part (each part followed by a host wait) to time each part.
"""

import dataclasses
import functools
from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfscale.cluster import devices
from tfscale.step.losses import add_others, metric_variables
from tfscale.step.feed import BatchCheck, input_error, is_input_error
from tfscale.step.replica import ReplicaStep
from tfscale.step.sharded_sync import ShardedSync
from tfscale.step.plan import StepPlan
from tfscale.step.row import RowLayout, StepsResult
from tfscale.errors import ConfigError
from tfscale.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where XLA compiles the step (see the module docstring).

    Attributes:
        one_replica: This worker holds one replica: XLA around
            `strategy.run`.
        alone: The job's only replica: no all-reduce.
        compute_xla: The forward/backward compiled (`jit_compile`).
        update_xla: The work after the all-reduce and the update compiled
            as one program (one replica, not sharded).
        fused: The whole step is one XLA program (alone, `jit_compile`
            and `compile_update`).
    """

    one_replica: bool
    alone: bool
    compute_xla: bool
    update_xla: bool
    fused: bool

    @classmethod
    def of(cls, config: TrainConfig, local_replicas: int, replicas: int,
           sharded: bool) -> "Layout":
        one = local_replicas == 1
        alone = replicas == 1
        compiled = config.jit_compile or config.compile_update
        return cls(one_replica=one, alone=alone,
                   compute_xla=config.jit_compile,
                   update_xla=one and compiled and not sharded,
                   fused=(one and alone and config.jit_compile
                          and config.compile_update))

    def describe(self, steps_per_launch: int = 1) -> str:
        """One line for the start banner."""
        if self.fused and steps_per_launch > 1:
            return (f"one XLA program per {steps_per_launch} steps (compute, "
                    "update; the batches taken before the launch)")
        if self.fused:
            return "one XLA program per step (compute, update)"
        parts = [("compute in XLA" if self.compute_xla
                  else "compute op by op"),
                 "no all-reduce" if self.alone else "all-reduce",
                 ("update in XLA" if self.update_xla
                  else "update op by op")]
        return ", ".join(parts)


class TrainStep:
    """Compiled training steps for one model.

    Args:
        model: A built Keras 3 model, created under `strategy.scope()`.
        optimizer: Its optimizer, created under the same scope (its own
            cross-replica sum off while the step traces:
            `trainer_parts.borrowed`).
        loss_fn: `keras.losses.Loss` or `fn(y_true, y_pred) -> [batch]`.
        metrics: Keras metrics updated with (y_true, y_pred) per micro-batch.
        strategy: The `tf.distribute` strategy.
        collectives: The backend's collectives (`collectives.py`): the
            all-reduce, and whether metric states must be summed here.
        config: The Trainer's `TrainConfig`.
        take_batches: `fn(iterator, k) -> k per-replica micro-batches`
            (`ReplicaFeed.take`); it runs inside the compiled call too.
        loss_scale: A `precision.DynamicLossScale` for fp16, else None.
        sharded: A `zero.ShardedOptimizer` (`shard_optimizer_state`): the
            gradients are reduce-scattered, each worker updates its shard
            and the weights are gathered (`zero/optimizer.py`); None: all-reduce and
            `optimizer.apply`.
    """

    def __init__(self, *, model, optimizer, loss_fn: Callable,
                 metrics: Sequence[keras.metrics.Metric], strategy,
                 collectives, config: TrainConfig, take_batches: Callable,
                 loss_scale=None, sharded=None):
        self._optimizer = optimizer
        self._metrics = list(metrics)
        self._strategy = strategy
        self._collectives = collectives
        self._config = config
        # Which steps each call runs (no TensorFlow in it).
        self.plan = StepPlan(config)
        self._take_batches = take_batches
        self._loss_scale = loss_scale
        self._sharded = sharded
        self._split_steps = 0
        self.layout = Layout.of(
            config, len(devices.worker_devices(strategy)),
            collectives.num_replicas, sharded is not None)
        if config.steps_per_launch > 1 and not self.layout.fused:
            raise ConfigError(
                "steps_per_launch", f"steps_per_launch "
                f"{config.steps_per_launch} needs the step to be one XLA "
                "program (one replica alone, jit_compile and the update "
                f"compiled); this step: {self.layout.describe()}")
        self._batch_check = BatchCheck.of(config, collectives.num_replicas)
        self.replica = ReplicaStep(
            model=model, optimizer=optimizer, loss_fn=loss_fn,
            metrics=metrics,
            metric_variables=metric_variables(metrics, collectives),
            config=config, num_replicas=collectives.num_replicas,
            loss_scale=loss_scale, nested_jit=not self.layout.one_replica)
        self.row = self.replica.row
        self._sharded_sync = (
            ShardedSync(sharded, collectives, self.replica.noise_groups,
                        self.replica.metric_variables,
                        measures_noise=self.replica.measures_noise,
                        loss_scale=loss_scale,
                        clip_global_norm=config.clip_global_norm,
                        compiled=config.jit_compile or config.compile_update)
            if sharded is not None else None)
        self._build_programs()
        # Values this object copied from the device to Python (each a wait
        # for the device): the loop's cost that does not show in a profile.
        self.host_reads = 0

    @property
    def noise_groups(self):
        return self.replica.noise_groups

    @property
    def measures_noise(self) -> bool:
        return self.replica.measures_noise

    @property
    def micro_batches_per_step(self) -> int:
        return self.replica.micro_batches_per_step

    def _build_programs(self) -> None:
        """The compiled functions, as `Layout` places XLA (each a
        `tf.function`; `jit_compile` only around `strategy.run`)."""
        layout = self.layout
        around = layout.one_replica
        # Op by op, each part stays a function of its own wherever it is
        # called (never inlined into its caller): Grappler then rewrites
        # it alike in a part-by-part step and inside a call of several,
        # and the two paths stay bit-identical, as XLA's programs are
        # (docs/facts.md, fact 33).
        opaque = {"_noinline": True}
        # Traced as Keras 3's fit traces its step: without AutoGraph (no
        # Python control flow on tensors, here or in the user's model, loss
        # and metrics). Converting the step's Python took about 1.5 s of
        # each worker's start (docs/facts.md, fact 34).
        program = functools.partial(tf.function, autograph=False)
        self._compute_program = program(
            self._compute, jit_compile=around and layout.compute_xla,
            experimental_attributes=opaque)
        self._sync_program = program(self._sync)
        self._after_reduce_program = program(
            self._after_reduce, jit_compile=layout.update_xla,
            experimental_attributes=opaque)
        self._update_program = program(
            self._update, jit_compile=layout.update_xla,
            experimental_attributes=opaque)
        self._finish_program = program(
            self._finish, jit_compile=layout.update_xla,
            experimental_attributes=opaque)
        self._step_program = (program(self._fused_step, jit_compile=True)
                              if layout.fused else self._one_step)
        self._steps_program = program(self._steps)
        # K > 1: K steps in one XLA program, the host launching once per K
        # (the fused layout only: a collective cannot sit in XLA here).
        self.steps_per_launch = self._config.steps_per_launch
        self._launch_program = (program(self._fused_launch, jit_compile=True)
                                if self.steps_per_launch > 1 else None)
        self._launches_program = program(self._launches)

    # ---- cross replica (traced into the programs) -------------------------

    def _compute(self, micro_batches):
        return self._strategy.run(self.replica.compute, args=(micro_batches,))

    def _sync(self, loss, grads, deltas, signals):
        """(row part, gradients, finite) after the all-reduce."""
        if self._sharded_sync is not None:
            return self._strategy.run(self._replica_sharded_sync,
                                      args=(loss, grads, deltas, signals))
        control, grads = self._strategy.run(
            self._replica_reduce, args=(loss, grads, deltas, signals))
        if self.layout.one_replica:
            return self._after_reduce_program(control, grads)
        return self._after_reduce(control, grads)

    def _after_reduce(self, control, grads):
        # A Python function, never a compiled one, goes to strategy.run
        # (with several replicas, `replica.after_reduce` is compiled).
        return self._strategy.run(
            lambda c, g: self.replica.after_reduce(c, g),
            args=(control, grads))

    def _update(self, grads, finite):
        """The update (fp16: only where `finite`); returns the skipped
        flag, float32 (1.0: skipped)."""
        finite = self._local(finite)
        if self._loss_scale is None:
            finite = None
        if self._sharded is not None:
            # Its gather cannot sit in a cond: it keeps the old values
            # itself where not `finite` (`zero.ShardedOptimizer.apply`).
            self._strategy.run(self._sharded.apply, args=(grads, finite))
        elif finite is None:
            self._strategy.run(self._replica_update, args=(grads,))
        else:
            # The same decision on every worker: `finite` is computed from
            # the all-reduced gradients. The cond sits here, not in the
            # replica function: TensorFlow refuses a `merge_call` (Keras's
            # update under a strategy) inside a replica function's cond.
            def update():
                self._strategy.run(self._replica_update, args=(grads,))
                return tf.constant(True)
            tf.cond(finite, update, lambda: tf.constant(False))
        if finite is None:
            return tf.constant(0.0)
        self._loss_scale.update(finite)
        return 1.0 - tf.cast(finite, tf.float32)

    def _finish(self, control, grads):
        """After the all-reduce: the after-reduce work and the update;
        returns the step's row."""
        control, grads, finite = self._after_reduce(control, grads)
        skipped = self._update(grads, finite)
        return tf.concat([self._local(control), [skipped]], axis=0)

    def _fused_step(self, micro_batches, signals):
        """A whole step of the job's only replica: one XLA program."""
        loss, grads, deltas = self._compute(micro_batches)
        control, grads = self._strategy.run(
            self._replica_reduce, args=(loss, grads, deltas, signals))
        return self._finish(control, grads)

    def _fused_launch(self, stacked, signals):
        """K whole steps of the job's only replica in one XLA program: a
        loop of static trip count K (so a GPU runs it without reading its
        condition back to the host) over `stacked`, the K steps'
        micro-batches stacked on a new first axis. Returns the rows [K, C].
        """
        k = self.steps_per_launch
        rows = tf.TensorArray(tf.float32, size=k,
                              element_shape=[self.row.size])

        def body(i, rows):
            micro_batches = tf.nest.map_structure(lambda t: t[i], stacked)
            return i + 1, rows.write(i, self._fused_step(micro_batches,
                                                         signals))

        _, rows = tf.while_loop(lambda i, _: i < k, body,
                                (tf.constant(0), rows), maximum_iterations=k)
        return rows.stack()

    def _one_step(self, micro_batches, signals):
        loss, grads, deltas = self._compute_program(micro_batches)
        if self._sharded_sync is not None or not self.layout.one_replica:
            control, grads, finite = self._sync(loss, grads, deltas, signals)
            skipped = self._update_program(grads, finite)
            return tf.concat([self._local(control), [skipped]], axis=0)
        control, grads = self._strategy.run(
            self._replica_reduce, args=(loss, grads, deltas, signals))
        return self._finish_program(control, grads)

    def _steps(self, iterator, signals, num_steps):
        """Up to `num_steps` whole steps, reading the input from `iterator`.

        Args:
            iterator: This worker's `tf.data` iterator.
            signals: float32 [3]: this worker's (stop, preempt) flags
                and its pace proposal (`pace.py`).
            num_steps: int32: the most steps to run; the loop leaves after
                the first step whose reduced flags are raised.

        Returns:
            (rows, metrics): rows [steps run, C], each
            [loss, stop, preempt, pace, noise numbers..., skipped] (the
            first four summed over replicas); metrics: the metric results after
            the last step, packed in one float32 vector.
        """
        k = self._config.num_accumulation_steps

        def run_step(i, rows):
            # Each step's input batch checked (`BatchCheck`: a dimension
            # unknown at tracing, compared where the shape lives, on the
            # host): a short or doubled batch in mid-call is refused as on
            # the call's first step.
            micro_batches = self._take_batches(iterator, k)
            with tf.control_dependencies(
                    self._batch_check(self._strategy, micro_batches)):
                row = self._step_program(micro_batches, signals)
            return row, rows.write(i, row)

        def one_step(i, rows):
            _, rows = run_step(i, rows)
            return i + 1, rows

        rows = tf.TensorArray(tf.float32, size=0, dynamic_size=True,
                              element_shape=[self.row.size])
        # The first step apart: its flags set the call's length.
        row, rows = run_step(0, rows)
        # Every worker's flags hold for its whole call, and the workers'
        # calls cover the same steps (`plan.steps_in_call`): the first
        # step's reduced flags are every step's. Read once, on the host,
        # they set how many steps the call runs, and the loop's condition
        # reads its counter alone. A condition on each step's flags copied
        # them to the host after every step: on a GPU the host could queue
        # step i + 1 only once step i had ended (fact 35).
        with tf.device("/cpu:0"):
            raised = row[RowLayout.STOP] + row[RowLayout.PREEMPT] > 0.0
            limit = tf.where(raised, tf.constant(1), num_steps)
        _, rows = tf.while_loop(lambda i, rows: i < limit, one_step,
                                (tf.constant(1), rows))
        return rows.stack(), self._packed_metrics()

    def _launches(self, iterator, signals, num_launches):
        """Up to `num_launches` launches of K steps (`_fused_launch`), as
        `_steps` runs single steps: each launch's K steps' batches are
        taken (and checked) on the host side of the call and stacked
        first; the first launch apart, whose first row's flags set the
        call's length (one launch when raised). Returns (rows [launches x
        K, C], metrics)."""
        k = self.steps_per_launch
        accumulation = self._config.num_accumulation_steps

        def launch(i, rows):
            steps = [self._take_batches(iterator, accumulation)
                     for _ in range(k)]
            checks = [check for micro_batches in steps
                      for check in self._batch_check(self._strategy,
                                                     micro_batches)]
            # (The job's only replica: its values, stacked on the host.)
            stacked = tf.nest.map_structure(
                lambda *parts: tf.stack([self._local(p) for p in parts]),
                *steps)
            with tf.control_dependencies(checks):
                block = self._launch_program(stacked, signals)
            for j in range(k):
                rows = rows.write(i * k + j, block[j])
            return block, rows

        def one_launch(i, rows):
            _, rows = launch(i, rows)
            return i + 1, rows

        rows = tf.TensorArray(tf.float32, size=0, dynamic_size=True,
                              element_shape=[self.row.size])
        block, rows = launch(0, rows)
        with tf.device("/cpu:0"):
            raised = block[0][RowLayout.STOP] + block[0][RowLayout.PREEMPT] > 0
            limit = tf.where(raised, tf.constant(1), num_launches)
        _, rows = tf.while_loop(lambda i, rows: i < limit, one_launch,
                                (tf.constant(1), rows))
        return rows.stack(), self._packed_metrics()

    # ---- per replica (around `ReplicaStep`) -------------------------------

    def _control(self, loss, signals):
        # The loss and the host's flags (stop_training, preemption) ride in
        # the gradients' all-reduce: every worker learns any worker's flags
        # at the same step, with no collective of their own; so do the
        # chief's pace proposal (`pace.py`) and the noise scale's
        # micro-batch norms and count (after the flags).
        control = tf.concat([loss[:1], tf.cast(signals, tf.float32),
                             loss[1:]], axis=0)
        assert control.shape[0] == self.row.reduced_width, control.shape
        return control

    def _replica_reduce(self, loss, grads, deltas, signals):
        """(row part, gradients) summed over every replica; the job's only
        replica has nothing to sum (and sends nothing)."""
        control = self._control(loss, signals)
        if self.layout.alone:
            return control, grads
        # tf.identity gives the values the replica's device: inputs that
        # come from another tf.function carry none, and all_reduce needs it.
        values = ([tf.identity(control)] + [tf.identity(g) for g in grads]
                  + [tf.identity(d) for d in deltas])
        reduced = self._collectives.all_reduce(values)
        add_others(self.replica.metric_variables, deltas,
                   reduced[1 + len(grads):])
        return reduced[0], reduced[1:1 + len(grads)]

    def _replica_sharded_sync(self, loss, grads, deltas, signals):
        return self._sharded_sync.sync(self._control(loss, signals), grads,
                                       deltas)

    def _replica_update(self, grads):
        self.replica.update(grads)

    def _packed_metrics(self):
        values = self.metric_results()
        return tf.stack([tf.cast(tf.reshape(v, []), tf.float32)
                         for v in values.values()] or
                        [tf.constant(0.0)])

    def metric_results(self):
        """{name: value} of every metric (read in the same dispatch)."""
        results = {}
        for metric in self._metrics:
            value = metric.result()
            if isinstance(value, dict):
                results.update(value)
            else:
                results[metric.name] = value
        return results

    # ---- the host side ------------------------------------------------------

    def run(self, step: int, num_steps: int, iterator, signals, timer,
            part_by_part: bool = False) -> StepsResult:
        """Runs optimizer steps `step` .. `step + num_steps - 1` (1-based;
        fewer if a flag is raised), from `plan.steps_in_call`, or step
        `step` alone part by part.

        Args:
            step: The first step's number.
            num_steps: From `plan.steps_in_call(step, ...)`.
            iterator: This worker's input iterator.
            signals: This worker's [stop, preempt] flags (0.0 / 1.0) and
                its pace proposal (`pace.CallPace.proposal`).
            timer: A `timing.StepTimer`.
            part_by_part: From `plan.part_by_part(step, ...)`: one step,
                each part followed by a host wait (timed if
                `plan.is_timed(step)`).

        Raises:
            InputPipelineError: Reading the input failed.
            BatchSizeError: The input's batches are not the per-replica
                batch.
        """
        signals = tf.constant(signals, tf.float32)
        self._batch_check.static(iterator.element_spec)
        if not part_by_part:
            timer.start()
            # Whole launches of K steps where the call has K or more; the
            # steps left over run in a later call, one at a time.
            launches = (num_steps // self.steps_per_launch
                        if self._launch_program is not None else 0)
            try:
                if launches:
                    rows, metrics = self._launches_program(
                        iterator, signals, tf.constant(launches))
                else:
                    rows, metrics = self._steps_program(
                        iterator, signals, tf.constant(num_steps))
            except tf.errors.OpError as e:
                batch_error = self._batch_check.error(e)
                if batch_error is not None:
                    raise batch_error from None
                if is_input_error(e):
                    raise input_error(e) from e
                raise
            rows = self._read(rows)
            metrics = dict(zip(self.metric_results_names(),
                               self._read(metrics).tolist()))
            timer.stop(timed=False, steps=len(rows))
            return self.row.result(rows, metrics)
        return self._run_part_by_part(iterator, signals, timer,
                                      self.plan.is_timed(step))

    def _run_part_by_part(self, iterator, signals, timer, timed: bool
                          ) -> StepsResult:
        """One step part by part, each part followed by a host wait."""
        timer.start()
        micro_batches = self._take_batches(
            iterator, self._config.num_accumulation_steps)
        self._batch_check(self._strategy, micro_batches)  # eager: static
        timer.mark("input_wait")
        loss, grads, deltas = self._compute_program(micro_batches)
        self._read(self._local(loss))  # wait for the backward pass
        timer.mark("compute")
        control, grads, finite = self._sync_program(loss, grads, deltas,
                                                    signals)
        control = self._read(self._local(control))
        timer.mark("sync")
        skipped = float(self._read(self._update_program(grads, finite)))
        timer.mark("update")
        # The very first part-by-part step traces the functions: not counted.
        timer.stop(timed=timed and self._split_steps > 0)
        self._split_steps += 1
        metrics = {k: float(self._read(v))
                   for k, v in self.metric_results().items()}
        return self.row.result([list(control) + [skipped]], metrics)

    def call_graph(self, iterator, num_steps: int = 10):
        """The traced graph of one call of several steps (the training
        loop's usual call), e.g. to count what runs outside XLA
        (`benchmarks/gpu/step_kernels.py`). Traces; runs nothing."""
        return self._steps_program.get_concrete_function(
            iterator, tf.TensorSpec([RowLayout.SIGNALS], tf.float32),
            tf.constant(num_steps)).graph

    def step_hlo(self, iterator) -> str:
        """The HLO text of one step's XLA program (the fused layout: the
        job's only replica with `jit_compile`), as TensorFlow hands it to
        XLA, before XLA's own passes: what a GPU compiles, checked on any
        machine (e.g. that a `--deterministic` step holds no scatter and
        no loop). Reads one step's batches from `iterator`.

        Raises:
            ValueError: The step is not one XLA program.
        """
        if not self.layout.fused:
            raise ValueError(f"the step is not one XLA program "
                             f"({self.layout.describe()})")
        micro_batches = self._take_batches(
            iterator, self._config.num_accumulation_steps)
        signals = tf.zeros([RowLayout.SIGNALS], tf.float32)
        return self._step_program.experimental_get_compiler_ir(
            micro_batches, signals)(stage="hlo")

    def metric_results_names(self) -> list:
        """The names of `metric_results()`, in its order."""
        if not hasattr(self, "_metric_names"):
            self._metric_names = list(self.metric_results())
        return self._metric_names

    def _read(self, value):
        """The value in Python (a wait for the device)."""
        self.host_reads += 1
        return value.numpy()

    def _local(self, value):
        return self._strategy.experimental_local_results(value)[0]
