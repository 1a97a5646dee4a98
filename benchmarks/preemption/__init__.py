"""Preemption and resume: from a signal to a checkpoint, a job's exit,
what a resume costs.

    python -m benchmarks.preemption --output_dir runs/preemption   # study.py

- `study.py`: from a SIGTERM to the checkpoint, at any steps per call
- `exit_time.py`: how long a finished job's workers take to leave
- `resume_cost.py`: time from fit to the first step at step 10 and at step
  5,000
"""
