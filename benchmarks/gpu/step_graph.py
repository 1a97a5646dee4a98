"""What the traced BERT training step holds: its ops by type and dtype, with
the elements each writes (from the traced static shapes), and XLA's compile
time for the per-replica step on this machine.

    python -m benchmarks.gpu.step_graph --bert_config_file=CONFIG \\
        --train_batch_size=256 --precision=mixed_bfloat16 [--top 25]

Elementwise work (Mul, Add, Cast, Select ...) is bound by memory: the
elements an op writes (and reads) are its cost on a GPU when nothing fuses
it, which is what TensorFlow does without XLA. A call of a function XLA
must compile (`tf.function(jit_compile=True)`, e.g. models/elementwise.py's
GELU and layer norm) is one fusion: it counts the elements of its outputs
(row "XlaFusion", named by the function), not the ops inside. The table
points at the ops to remove or to leave to XLA's fusion; `--compile` times
XLA's compilation of the per-replica forward/backward (with the
accumulation and the metrics) on this machine's CPU.
"""

import argparse
import collections
import json
import time

import numpy as np


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bert_config_file", required=True,
                   help="Google's bert_config.json")
    p.add_argument("--train_batch_size", type=int, default=256,
                   help="per-replica batch")
    p.add_argument("--max_seq_length", type=int, default=128,
                   help="tokens a sequence")
    p.add_argument("--max_predictions_per_seq", type=int, default=20,
                   help="masked positions a sequence")
    p.add_argument("--precision", default="mixed_bfloat16",
                   choices=["float32", "mixed_bfloat16", "mixed_float16"],
                   help="the step's Keras dtype policy")
    p.add_argument("--top", type=int, default=25, help="rows of the table")
    p.add_argument("--compile", action="store_true",
                   help="also time XLA's compilation on this machine")
    p.add_argument("--json", default=None, help="also write the table here")
    p.add_argument("--update", default=None, choices=["lamb", "adamw", "sgd"],
                   help="instead: count the kernels of this optimizer's "
                        "update of every variable, op by op against "
                        "XLA's compiled update (TrainConfig.compile_update)")
    return p.parse_args()


def features(batch, seq, preds):
    import tensorflow as tf
    rng = np.random.default_rng(0)
    x = {"input_ids": rng.integers(0, 1000, (batch, seq)),
         "input_mask": np.ones((batch, seq)),
         "segment_ids": np.zeros((batch, seq)),
         "masked_lm_positions": rng.integers(0, seq, (batch, preds))}
    y = {"masked_lm_ids": rng.integers(0, 1000, (batch, preds)),
         "masked_lm_weights": np.ones((batch, preds)),
         "next_sentence_labels": np.zeros((batch, 1))}
    cast = lambda d, t: {k: tf.constant(v, t if k != "masked_lm_weights"  # noqa: E731
                                        else tf.float32) for k, v in d.items()}
    return cast(x, tf.int32), cast(y, tf.int32)


# Where an op comes from, by the first of these found in its name (gradient
# ops carry their forward op's name under gradient_tape/).
PARTS = (("gelu", "GELU"), ("Gelu", "GELU"), ("dropout", "dropout"),
         ("layer_norm", "layer norm"), ("Softmax", "attention softmax"),
         ("attention", "attention"), ("intermediate", "feed-forward"),
         ("output", "dense outputs"), ("mlm_", "masked-LM head"),
         ("metric", "metrics"), ("mean", "metrics"),
         ("sparse_categorical", "loss"), ("embeddings", "embeddings"))
MATMULS = {"MatMul", "BatchMatMulV2", "BatchMatMul"}
MOVES = {"Reshape", "ReadVariableOp", "Identity", "IdentityN", "Const",
         "Shape",
         "StridedSlice", "Pack", "ConcatV2", "Bitcast", "Transpose",
         "GatherV2", "Tile", "BroadcastTo", "ExpandDims", "Squeeze"}


def part_of(name: str) -> str:
    for key, part in PARTS:
        if key in name:
            return part
    return "other"


def _elements(tensor) -> int:
    shape = tensor.shape
    return (shape.num_elements() or 0) if shape.is_fully_defined() else 0


def _compiled_function(op) -> str:
    """The name of the function `op` calls if XLA must compile it, else ''
    (XLA compiles such a call as one cluster)."""
    attrs = op.node_def.attr
    if "_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b \
            and "f" in attrs:
        return attrs["f"].func.name
    return ""


def op_table(graph, by_part=None) -> list:
    """[(op type, dtype, ops, elements written)] of a graph and the
    functions it calls, largest first. `by_part`, a dict, also gets
    {part: elements} of the elementwise ops (neither matmuls nor data
    movement), by where their names say they come from."""
    rows = collections.defaultdict(lambda: [0, 0])
    seen = set()

    def count(op, op_type, outputs, name):
        n = sum(_elements(out) for out in outputs)
        key = (op_type, outputs[0].dtype.name)
        rows[key][0] += 1
        rows[key][1] += n
        if (by_part is not None and op_type not in MATMULS
                and op_type not in MOVES and outputs[0].dtype.is_floating):
            part = part_of(name)
            by_part[part] = by_part.get(part, 0) + n

    def visit(g):
        used = {t.name for op in g.get_operations() for t in op.inputs}
        used |= {t.name for t in getattr(g, "outputs", [])}
        for op in g.get_operations():
            if (op.outputs and not op.op_def.is_stateful
                    and not any(t.name in used for t in op.outputs)):
                continue  # dead: Grappler prunes it (e.g. unused zeros)
            function = _compiled_function(op)
            if function:  # one fusion: its outputs, nothing inside
                count(op, "XlaFusion", op.outputs, function + op.name)
                continue
            if op.outputs:
                count(op, op.type, op.outputs[:1], op.name)
            for attr in ("f", "then_branch", "else_branch", "body", "cond"):
                try:
                    fn = op.get_attr(attr)
                except (ValueError, TypeError):
                    continue
                name = getattr(fn, "name", None)
                if name and name not in seen and name in g._functions:
                    seen.add(name)
                    visit(g._functions[name].graph)
    visit(graph)
    return sorted(((t, d, c, n) for (t, d), (c, n) in rows.items()),
                  key=lambda r: -r[3])


def update_kernels(model, name: str) -> tuple:
    """(ops of the update traced op by op, fusions and other kernels in
    XLA's optimized HLO of the same update on this machine)."""
    import tensorflow as tf
    from tfscale.optim import OptimConfig, make_optimizer
    variables = model.trainable_variables
    optimizer = make_optimizer(OptimConfig(optimizer=name), 256, variables)
    optimizer.build(variables)
    grads = [tf.zeros_like(v) for v in variables]

    def update(grads):
        optimizer.apply(grads, variables)
        return optimizer.iterations

    plain = tf.function(update).get_concrete_function(grads).graph
    ops = sum(row[2] for row in op_table(plain)
              if row[0] not in MOVES and row[0] not in ("NoOp", "Placeholder"))
    hlo = tf.function(update, jit_compile=True).experimental_get_compiler_ir(
        grads)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY"):]
    kernels = [line for line in entry.splitlines()[1:]
               if " = " in line and not any(
                   f" {kind}(" in line for kind in (
                       "parameter", "constant", "tuple", "get-tuple-element",
                       "bitcast", "copy"))]
    return ops, len(kernels)


def main():
    args = parse_args()
    import keras
    import tensorflow as tf
    from models import bert
    from models.bert_config import BertConfig
    from tfscale import precision
    from tfscale.step.losses import unreduced

    precision.set_precision(args.precision)
    config = BertConfig.from_json_file(args.bert_config_file)
    model = bert.make_pretrainer(config, args.max_seq_length,
                                 args.max_predictions_per_seq)
    if args.update:
        ops, kernels = update_kernels(model, args.update)
        print(f"{args.update} update of {len(model.trainable_variables)} "
              f"variables: {ops} ops traced op by op (each a kernel without "
              f"XLA); XLA's optimized HLO on this machine: {kernels} "
              "instructions in its entry computation (fusions and the "
              "rest)")
        return
    metrics = bert.pretraining_metrics()
    loss_fn = unreduced(bert.pretraining_loss)
    variables = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = tf.reduce_sum(loss_fn(y, pred, None)) / 256.0
        grads = tape.gradient(loss, variables)
        grads = [tf.convert_to_tensor(g) for g in grads]
        for m in metrics:
            m.update_state(y, pred)
        return loss, grads

    x, y = features(args.train_batch_size, args.max_seq_length,
                    args.max_predictions_per_seq)
    graph = tf.function(step).get_concrete_function(x, y).graph
    parts = {}
    table = op_table(graph, parts)
    total = sum(r[2] for r in table)
    print(f"{args.precision}, batch {args.train_batch_size}: {total} ops")
    print(f"{'op':<28}{'dtype':<10}{'ops':>6}{'elements written':>20}")
    for t, d, c, n in table[:args.top]:
        print(f"{t:<28}{d:<10}{c:>6}{n:>20,}")
    matmul = sum(n for t, _, _, n in table if t in MATMULS)
    elementwise = sum(parts.values())
    print(f"\nelements written by matmuls {matmul:,}; by floating-point "
          f"elementwise ops {elementwise:,} ({elementwise / matmul:.1f}x), "
          "of which:")
    for part, n in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<20}{n:>20,}  {100 * n / elementwise:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(op=t, dtype=d, ops=c, elements=n)
                       for t, d, c, n in table], f, indent=1)
    if args.compile:
        # The first call traces, compiles and runs; the second only runs.
        compiled = tf.function(step, jit_compile=True)
        start = time.perf_counter()
        compiled.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")
        hlo = time.perf_counter() - start
        start = time.perf_counter()
        compiled(x, y)[0].numpy()
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiled(x, y)[0].numpy()
        second = time.perf_counter() - start
        print(f"XLA on this CPU: trace and HLO optimisation {hlo:.1f} s; "
              f"first call {first:.1f} s, second {second:.1f} s: compilation "
              f"about {first - second:.1f} s")


if __name__ == "__main__":
    main()
