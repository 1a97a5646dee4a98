"""Scale on paper: step time, efficiency and time to a target at 8 to
4,096 GPUs, from one short run (or a published row) and a system's links.

What it owns, one module a job:

- `systems.py`: a machine as the model sees it (GPUs per node, the links
  inside a node and between nodes), presets and a JSON format for one's own;
- `collectives.py`: the cost of an all-reduce (ring, tree) and of ZeRO-1's
  reduce-scatter + all-gather on a system, latency plus bandwidth terms,
  and the fit of those two terms to a measured size sweep;
- `workload.py`: what a step does per GPU (micro-batch seconds, update,
  fixed overhead, jitter, gradient bytes and tensors) and how to read it
  from a run's summary.json;
- `frameworks.py`: what the training software adds to a step (the update's
  passes over the weights, a cost per gradient tensor, overlap), presets
  with their sources;
- `preset_files.py`: a preset by name or a JSON file of its fields, each
  refusal one line (what `--system` and `--framework` take);
- `projection.py`: the step split at N GPUs, throughput, weak and strong
  scaling efficiency, the bandwidth a target efficiency needs, time to a
  target from the gradient noise scale, and uncertainty bands;
- `calibrate.py`: the unknowns of a workload solved from measured rows
  (a 1-node and a 2-node throughput);
- `time_to_train.py`: minutes to a target at any GPU count from two
  measured results (a step's fixed and per-example parts, the examples a
  batch needs), checked against MLPerf Training;
- `published.py` (with `published.json`): published multi-node tables with
  their source, for the checks in tests/test_planning.py;
- `cli.py`: `tfscale-plan` / `python -m planning` (what it assumed, the
  table, --json, --plot, --measured and --link calibration, cost).

It imports no TensorFlow, Keras or tfscale: a plan answers in a blink on any
laptop. Data parallelism only (see docs/planning.md for its limits).
"""
