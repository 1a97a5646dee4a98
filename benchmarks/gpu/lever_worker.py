r"""One run of `benchmarks/gpu/levers.py`: the BERT job with a gate.

    python -m benchmarks.gpu.lever_worker --gate_dir DIR --run_name NAME \
        --gate_after_steps 40 --timed_steps 200 [--profile] -- RUN_PRETRAINING_FLAGS

`run_pretraining.py`'s job (its flags, records, model, Trainer) with one
callback more: once past `--gate_after_steps` (tracing, compilation,
autotuning done) and past the first launch of `--steps_per_launch` steps
(compiled at its first call, whenever the call sizes reach it), it writes
`NAME.ready` and waits for `NAME.go`, which the
orchestrator writes when no other run compiles or is timed; then it times
the calls that cover `--timed_steps` steps (the wall time between the
ends of whole calls, the device's work included: each call ends with a
read of its results), writes `NAME.json`, with `--profile` profiles the
next call into `DIR/NAME-profile`, and ends the process (no final
checkpoint or export: nothing of them is measured).
"""

import argparse
import json
import os
import sys
import time


def _gate_callback(trainer, path, warmup, timed, profile):
    import keras
    import tensorflow as tf

    class Gate(keras.callbacks.Callback):
        """Waits at the gate, times, profiles, leaves (see the module
        docstring)."""

        def __init__(self):
            super().__init__()
            self.start = None
            self.profiling = None
            self.result = None

        def on_train_batch_end(self, batch, logs=None):
            step = int(trainer.step.numpy())
            if self.profiling is not None:
                tf.profiler.experimental.stop()
                self._write(profiled_steps=step - self.profiling)
                os._exit(0)
            if self.start is None and step >= warmup and trainer.launch_ran:
                open(path + ".ready", "w").close()
                while not os.path.exists(path + ".go"):
                    time.sleep(0.05)
                self.start = (step, time.perf_counter())
            elif self.start is not None and step - self.start[0] >= timed:
                first, began = self.start
                seconds = time.perf_counter() - began
                self.result = {"steps": step - first, "seconds": seconds,
                               "examples_per_second":
                                   (step - first)
                                   * trainer.config.global_batch_size
                                   / seconds,
                               "step_layout": trainer.step_layout}
                if not profile:
                    self._write()
                    os._exit(0)
                tf.profiler.experimental.start(path + "-profile")
                self.profiling = step

        def _write(self, **more):
            with open(path + ".json", "w") as f:
                json.dump({**self.result, **more}, f)
            open(path + ".done", "w").close()
            sys.stdout.flush()

    return Gate()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s --gate_dir DIR --run_name NAME [options] -- "
              "RUN_PRETRAINING_FLAGS")
    parser.add_argument("--gate_dir", required=True,
                        help="where the gate's files go")
    parser.add_argument("--run_name", required=True,
                        help="this run's name in them")
    parser.add_argument("--gate_after_steps", type=int, default=40,
                        help="steps before the gate (default: 40)")
    parser.add_argument("--timed_steps", type=int, default=200,
                        help="steps timed, at least (default: 200)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one call after the timing")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main(argv=None) -> int:
    args, job_flags = parse_args(argv)
    # The job's flags, read as run_pretraining.py reads them.
    from absl import flags
    from models.tasks import run_pretraining
    from models.tasks.pretraining import Pretraining
    from tfscale import jobs
    flags.FLAGS(["run_pretraining", *job_flags])
    path = os.path.join(args.gate_dir, args.run_name)
    config = run_pretraining.config_from_flags()

    class Gated(Pretraining):
        def callbacks(self, trainer):
            return [*super().callbacks(trainer), _gate_callback(
                trainer, path, args.gate_after_steps, args.timed_steps,
                args.profile)]

    jobs.run(Gated(config))
    # (The gate ends the process; reaching here: the run ended first.)
    print(f"lever_worker: {args.run_name} ended before its timed steps",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
