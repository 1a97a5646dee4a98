"""The benchmarks, by concern; each study's command and results are in
benchmarks/README.md, and `harness.py` starts jobs, reads what they said
and writes the tables for all of them.

- `gpu/`: the step on one device (BERT's step, its kernels, the GPU check)
- `pipelines/`: input pipelines and record writers
- `scaling/`: many workers, the all-reduce, Horovod's benchmark, memory
- `preemption/`: from a signal to a checkpoint, exits, resumes
- `planning/`: tfscale-plan against real runs and MLPerf's results
- `time_to_accuracy/`: what each global batch costs in steps and examples
- `overhead/`: what the engine costs around the model
- `harness.py`: start a job, read its output, write a table

The flat names of release 2026-12 (`python -m benchmarks.gpu_check`, ...)
still run, with a line naming the new one; they go in the next release.
"""

import importlib.abc
import importlib.util
import sys

# Old flat module name -> where it lives now.
MOVED = {
    "gpu_check": "gpu.check",
    "gpu_levers": "gpu.levers",
    "lever_worker": "gpu.lever_worker",
    "model_step": "gpu.model_step",
    "step_calls": "gpu.step_calls",
    "step_graph": "gpu.step_graph",
    "step_kernels": "gpu.step_kernels",
    "head_transpose": "gpu.head_transpose",
    "xplane_top": "gpu.xplane_top",
    "input_pipeline": "pipelines.input_pipeline",
    "image_pipeline": "pipelines.image_pipeline",
    "record_reader": "pipelines.record_reader",
    "data_service_trainer": "pipelines.data_service_trainer",
    "data_service": "pipelines.data_service",
    "iterator_deletion_worker": "pipelines.iterator_deletion_worker",
    "iterator_deletion": "pipelines.iterator_deletion",
    "writer_memory": "pipelines.writer_memory",
    "writers": "pipelines.writers",
    "scaling_worker": "scaling.worker",
    "allreduce_worker": "scaling.allreduce_worker",
    "allreduce": "scaling.allreduce",
    "horovod_synthetic": "scaling.horovod_synthetic",
    "hvd_agreement": "scaling.hvd_agreement",
    "memory": "scaling.memory",
    "exit_time": "preemption.exit_time",
    "resume_cost": "preemption.resume_cost",
    "plan_check": "planning.plan_check",
    "mlperf_rows": "planning.mlperf_rows",
    "study_behaviour": "time_to_accuracy.behaviour",
    "trainer_overhead": "overhead.trainer",
    "fit_comparison": "overhead.fit_comparison",
    "fit_worker": "overhead.fit_worker",
    "watch_cost": "overhead.watch_cost",
    "noise_scale_overhead": "overhead.noise_scale",
}


class _Moved(importlib.abc.MetaPathFinder):
    """Finds `benchmarks.<old name>` at its new file, saying so once."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        new = f"{__name__}.{MOVED[name]}"
        print(f"benchmarks: {fullname} is now {new}; the old name goes "
              "in the next release", file=sys.stderr)
        spec = importlib.util.find_spec(new)
        return importlib.util.spec_from_file_location(fullname, spec.origin)


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
