"""The step on one device: what BERT's training step costs and launches,
and the GPU node check.

- `check.py`: the GPU node check (`tfscale-gpu-check`) and BERT on one GPU with
  its levers, in one call
- `levers.py`: BERT on one GPU: the defaults, each lever alone and all together
- `lever_worker.py`: one run of levers.py: the BERT job with a gate
- `bert.sh`: BERT-base and BERT-large on one GPU (the job's own command lines)
- `bert_base.json`: BERT-base's config
- `model_step.py`: the BERT model's own step time: forward, backward, metrics
- `step_calls.py`: steps per call, XLA, and what the host waits for
- `step_graph.py`: the traced step's ops by type and dtype, and XLA's programs
- `step_kernels.py`: the TensorFlow kernels the step launches outside XLA
- `head_transpose.py`: moving BERT-base's attention heads: transpose against
  XLA
- `xplane_top.py`: where a profile's device time went, by kernel and op
"""
