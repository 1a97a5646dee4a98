"""Many workers: speedup and where the step goes, the all-reduce on its
link, Horovod's benchmark, memory at scale.

    python -m benchmarks.scaling --model materials_mlp --workers 1,2   # study.py

- `study.py`: the scaling report: speedup, efficiency, the step split
- `worker.py`: one worker of a scaling measurement
- `allreduce.py`: tfscale's all-reduce backends against the link
- `allreduce_worker.py`: one rank of allreduce.py
- `horovod_synthetic.py`: Horovod's synthetic benchmark through tfscale.horovod
  against the Trainer
- `hvd_agreement.py`: what tfscale.horovod's argument check costs
- `memory.py`: sharded optimizer state and recomputed activations
"""
