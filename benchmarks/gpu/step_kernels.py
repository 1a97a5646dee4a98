r"""TensorFlow kernels the BERT step launches outside XLA programs, per step,
counted in the traced graph of the training loop's call.

    python -m benchmarks.gpu.step_kernels [--bert_config_file benchmarks/gpu/bert_base.json]
        [--device /gpu:0] [--steps_per_call 50] [--json out.json]

One worker with one replica, as a one-GPU job runs (on a CPU machine
`--device /gpu:0` takes tf.distribute's GPU branch with the ops placed on
the CPU: `tests/gpu_branch.py`); BERT in mixed_bfloat16, LAMB, global batch
256, sequence 128, 20 predictions; nothing runs, the call is only traced.
For each layout of the step, the ops of one call of `--steps_per_call`
steps (`Trainer` with `steps_per_execution`), counted where they run:
inside the loop's body once per step, around it once per call (divided by
the steps). A call of an XLA-compiled function is one launch (its kernels
are XLA's); every other op is a kernel TensorFlow dispatches on the host,
one by one, except Const, Identity and NoOp (no kernel). The graph is the
one traced, before Grappler's pruning: an upper bound of what runs.

Layouts (`--layouts`):
  uncompiled_update  --xla with the update op by op
                     (TrainConfig(compile_update=False)): what ran on GPUs
                     before the update's compilation moved around
                     strategy.run (a compiled update failed there)
  noxla              --noxla: the forward/backward op by op, then one
                     program for the rest (the update compiled)
  default            the job's default on one GPU (XLA on): the whole step
                     one XLA program
"""

import argparse
import collections
import dataclasses
import json

LAYOUTS = {
    "uncompiled_update": dict(jit_compile=True, compile_update=False,
                              uncompiled_update=True),
    "noxla": dict(jit_compile=False, compile_update=True),
    "default": dict(jit_compile=True, compile_update=True),
}
NO_KERNEL = {"Const", "Identity", "IdentityN", "NoOp", "Placeholder",
             "_Arg", "_Retval"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bert_config_file", default="benchmarks/gpu/bert_base.json",
                   help="BERT config JSON")
    p.add_argument("--device", default="/gpu:0",
                   help="the device the step is placed on")
    p.add_argument("--steps_per_call", type=int, default=50,
                   help="steps in one call of the compiled step")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="step layouts counted, comma-separated")
    p.add_argument("--json", default=None, help="also write the counts here")
    return p.parse_args()


def _xla_function(op) -> str:
    attrs = op.node_def.attr
    if "_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b:
        return attrs["f"].func.name
    return ""


def _called_functions(op, graph) -> list:
    names = []
    for attr in ("f", "then_branch", "else_branch", "body", "cond",
                 "branches"):
        try:
            value = op.get_attr(attr)
        except (ValueError, TypeError):
            continue
        for fn in value if isinstance(value, list) else [value]:
            name = getattr(fn, "name", None)
            if name and name in graph._functions:
                names.append(name)
    return names


def count_ops(graph) -> tuple:
    """(per call, per step): Counters of op type -> launches; an XLA call
    counts as "XLA program"; the `While` loop's body (and what it calls)
    is per step, the rest per call."""
    per_call, per_step = collections.Counter(), collections.Counter()
    root = graph

    def visit(g, counter):
        for op in g.get_operations():
            if _xla_function(op):
                counter["XLA program"] += 1
                continue
            called = _called_functions(op, root)
            if op.type in ("While", "StatelessWhile"):
                for name in called:
                    body = op.get_attr("body").name
                    visit(root._functions[name].graph,
                          per_step if name == body else counter)
                continue
            if called:
                for name in called:
                    visit(root._functions[name].graph, counter)
                continue
            if op.type not in NO_KERNEL:
                counter[op.type] += 1
    visit(graph, per_call)
    return per_call, per_step


def condition_reads(graph) -> list:
    """The dtypes of the values the loop's condition reads (the `While`
    op's loop variables and captures its predicate depends on). A value the
    step computes on the device (the flags in its row, float32) makes each
    step's end a copy to the host: the host queues the next step only once
    the last has ended. The counter and the call's limit are int32, which
    TensorFlow keeps on the host."""
    for op in graph.get_operations():
        if op.type in ("While", "StatelessWhile"):
            cond = graph._functions[op.get_attr("cond").name].graph
            break
    else:
        raise ValueError("the call's graph holds no While loop")
    inputs = {t.ref() for t in cond.inputs}
    seen, stack, reads = set(), [cond.outputs[0].op], []
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        for tensor in op.inputs:
            if tensor.ref() in inputs:
                reads.append(tensor.dtype.name)
            stack.append(tensor.op)
    return sorted(reads)


def trace_layout(fields: dict, args, bert_config: dict):
    """The traced graph of one call of `args.steps_per_call` steps."""
    import keras
    import tensorflow as tf
    from benchmarks.gpu.step_calls import make_data
    from models import bert
    from models.bert_config import BertConfig
    from tfscale import precision
    from tfscale.optim.lamb import Lamb
    from tfscale.step.feed import ReplicaFeed
    from tfscale.trainer.loop import TrainConfig, Trainer

    fields = dict(fields)
    uncompiled_update = fields.pop("uncompiled_update", False)
    precision.set_precision("mixed_bfloat16")
    strategy = tf.distribute.MirroredStrategy([args.device])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = bert.make_pretrainer(BertConfig.from_dict(bert_config),
                                     128, 20)
        optimizer = Lamb(1e-4, weight_decay_rate=0.01)
        metrics = bert.pretraining_metrics()
    trainer = Trainer(
        model=model, optimizer=optimizer, loss_fn=bert.pretraining_loss,
        strategy=strategy, metrics=metrics, config=TrainConfig(
            global_batch_size=256, precision="mixed_bfloat16",
            steps_per_execution=args.steps_per_call,
            log_steps=args.steps_per_call, verbose=0, **fields))
    if uncompiled_update:
        # No config asks for it (--xla compiles the update): the layout
        # measured before, rebuilt here.
        step = trainer._train_step
        step.layout = dataclasses.replace(step.layout, update_xla=False,
                                          fused=False)
        step._build_programs()
    data = make_data(256, 128, 20, bert_config["vocab_size"])
    feed = ReplicaFeed(strategy, lambda context: data, num_replicas=1,
                       num_workers=1, worker_index=0)
    trainer._replica_feed = feed  # what fit sets: the call reads it
    from tfscale.trainer import parts as trainer_parts
    with trainer_parts.borrowed(model, trainer.optimizer):  # as in fit
        graph = trainer._train_step.call_graph(feed.iterator,
                                               args.steps_per_call)
    return graph, trainer


def main():
    args = parse_args()
    with open(args.bert_config_file) as f:
        bert_config = json.load(f)
    rows = {}
    for name in args.layouts.split(","):
        graph, trainer = trace_layout(LAYOUTS[name], args, bert_config)
        per_call, per_step = count_ops(graph)
        launches = (sum(per_step.values())
                    + sum(per_call.values()) / args.steps_per_call)
        reads = condition_reads(graph)
        rows[name] = {"per_step": launches,
                      "step_layout": trainer.step_layout,
                      "loop_condition_reads": reads,
                      "in_each_step": dict(per_step.most_common()),
                      "around_the_loop": dict(per_call.most_common())}
        print(f"== {name} ({trainer.step_layout}): {launches:.1f} launches "
              f"per step outside XLA ({sum(per_step.values())} in each "
              f"step, {sum(per_call.values())} per call of "
              f"{args.steps_per_call})")
        print("   in each step: " + ", ".join(
            f"{t} {n}" for t, n in per_step.most_common()))
        print("   the loop's condition reads: " + ", ".join(reads) + (
            "" if set(reads) <= {"int32"} else
            " (a step's output: each step ends in a wait for the device)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
