r"""Prove a GPU node in one command: it trains on its GPUs, over NCCL, as one
worker does, at what speed, and a preemption resumes exactly.

    tfscale-gpu-check --output_dir OUT             # every GPU this node sees
    tfscale-gpu-check --output_dir OUT --gpus 4    # the first 4
    tfscale-gpu-check --output_dir OUT --tiny      # the same, small, on a CPU
    python -m launch.gpu_check ...                 # the same command
    # SLURM: inside an allocation, the N-worker runs through srun
    salloc -N 2 --ntasks-per-node 8 --gpus-per-task 1 \
        tfscale-gpu-check --output_dir OUT --launcher srun

BERT-base (sequence 128, 20 predictions, LAMB, mixed_bfloat16; BERT-tiny in
float32 with `--tiny`) on synthetic records, through the BERT job
(`models.tasks.run_pretraining`). N is the GPUs it sees (or `--gpus`), one
worker a GPU over NCCL; on a node with one GPU, 2 workers share it over the
gRPC ring (NCCL refuses two ranks on one GPU), and the table says so. The
phases, in order (`PHASES`):

  records      4,096 synthetic BERT records (input_pipelines.synthetic_bert)
  equivalence  1 worker and N workers at one global batch (--deterministic,
               no dropout, seed 7), and beside them the N workers again,
               SIGTERM to worker 1 after its first checkpoint: every
               worker's placement line, the N-worker weights against the 1
               worker's, seconds from the signal to the complete checkpoint
               and to the exit
  speed        N workers, BERT-base as trained (dropout), alone: steps a
               second, examples/s and the share of the GPUs' peak
  all-reduce   tfscale.cluster.link_probe on the N workers: each size's bus
               bandwidth as nccl-tests define it (algbw x 2(N-1)/N),
               against the link between GPU 0 and 1 (nvidia-smi topo -m)
  resume       the SIGTERMed run again: it resumes and must end
               bit-identical to the uninterrupted N-worker run (compared
               only when the signal was delivered and the first exit was
               143)
  speed-1      1 worker alone, as `speed`: the scaling efficiency

`results.json` and `table.md` in --output_dir are rewritten after every
phase, so a run cut short keeps what it measured; a phase whose estimate
does not fit in what is left of `--budget_seconds` is skipped and named.
Exit 0 when every phase that ran passed its check, 1 otherwise.
Never imports TensorFlow (the jobs do). The package:

    figures.py   the phases and their estimates, and the formulas and
                 verdicts: FLOPs a sequence, bus bandwidth, the link,
                 the SIGTERM row
    report.py    the budget, and results.json / table.md after each phase
    phases.py    the node's layout, the jobs each phase starts, run_phases
    cli.py       the command line (tfscale-gpu-check, python -m
                 launch.gpu_check)
"""
