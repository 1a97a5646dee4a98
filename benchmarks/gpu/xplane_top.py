r"""Where a profile's device time went: TensorFlow's profile (`.xplane.pb`)
summed by kernel and by TensorFlow op, per device, with no TensorBoard.

    python run_pretraining.py ... --iterations_per_loop=1 --profile_steps=24,26
    python -m benchmarks.gpu.xplane_top runs/bert [TOP]

Reads the newest `.xplane.pb` under the folder (the TensorBoard callback
writes it under `<output_dir>/.../plugins/profile/<run>/`). For each GPU
plane: the total of its events' durations, the TOP kernels by time (summed
by their full names: templated Eigen kernels differ only past the first
hundred characters, so a cut name would merge many kernels into one row;
the table prints at most WIDTH characters of each), the same time grouped
by the TensorFlow op type each kernel ran for (the `tf_op` stat:
`name:type`), and grouped by (op type, dtype), the dtype read from the
kernel's name (`bfloat16`, `float` ... in its template arguments or its
`_GPU_DT_...` suffix), each with its share. On a machine with no GPU it
sums the host's TensorFlow op events instead ("/host:CPU").

Two spellings need more than a word match. cuBLAS's and CUTLASS's GEMM
kernels name their types after `gemm_`: the inputs, then the math and
accumulator types: `sm90_xmma_gemm_bf16bf16_bf16f32_f32_...` multiplies
bfloat16 with float32 accumulation ("bf16 (f32 acc)"), where a word match
would read the lone `f32`; `..._gemm_f32f32_tf32f32_...` is TF32 math on
float32 inputs ("tf32 (f32 acc)"). TensorFlow moves 2-byte elements
(bfloat16 or float16 transposes, copies, concatenations) as Eigen tensors of
`unsigned short` ("16-bit move").

`--steps N` also prints the profile per step: the GPU's idle time (the
profile's window less the union of its events) and its kernel time by kind
(GEMM, attention, dropout, LAMB, other: `kind_of`, from the kernel's name
and the TensorFlow op it ran for).
"""

import argparse
import collections
import glob
import os
import re
import sys

from tensorflow.tsl.profiler.protobuf import xplane_pb2


def newest_profile(folder: str) -> str:
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"),
                      recursive=True)
    if not files:
        sys.exit(f"xplane_top: no .xplane.pb under {folder}")
    return max(files, key=os.path.getmtime)


WIDTH = 150

# Element types as kernel names spell them, the more specific first.
_DTYPES = (("bfloat16", "bf16"), ("BFLOAT16", "bf16"), ("bf16", "bf16"),
           ("BF16", "bf16"), ("Eigen::half", "f16"), ("__half", "f16"),
           ("HALF", "f16"), ("f16", "f16"), ("fp16", "f16"),
           ("DOUBLE", "f64"), ("double", "f64"), ("f64", "f64"),
           ("FLOAT", "f32"), ("float", "f32"), ("f32", "f32"),
           ("int", "int"), ("bool", "bool"))


# A GEMM kernel's type run: `gemm_` then types glued (bf16bf16_bf16f32).
_GEMM_TYPES = re.compile(
    r"gemm_((?:bf16|tf32|f16|f32|f64|e4m3|e5m2|s8|i8)+)"
    r"_((?:bf16|tf32|f16|f32|f64|s32|i32)+)")
_GEMM_TYPE = re.compile(r"bf16|tf32|f16|f32|f64|e4m3|e5m2|s8|i8|s32|i32")


def _gemm_dtype(name: str):
    """"bf16 (f32 acc)" for a cuBLAS/CUTLASS GEMM named with its types,
    else None."""
    found = _GEMM_TYPES.search(name)
    if not found:
        return None
    math = _GEMM_TYPE.findall(found.group(2))
    if len(math) > 1 and math[-1] != math[0]:
        return f"{math[0]} ({math[-1]} acc)"
    return math[0]


def kernel_dtype(name: str) -> str:
    """The element type a kernel's name says, or '?'."""
    gemm = _gemm_dtype(name)
    if gemm:
        return gemm
    if re.search(r"\bunsigned short\b", name):
        return "16-bit move"
    for spelled, dtype in _DTYPES:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(spelled)}(?![A-Za-z0-9])",
                     name):
            return dtype
    return "?"


def plane_times(plane):
    """(total ms, Counter of full kernel name -> ms, Counter of op type ->
    ms, Counter of (op type, dtype) -> ms)."""
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    kernels, ops = collections.Counter(), collections.Counter()
    typed = collections.Counter()
    total = 0.0
    for line in plane.lines:
        for event in line.events:
            ms = event.duration_ps / 1e9
            name = names.get(event.metadata_id, "?")
            kernels[name] += ms
            total += ms
            for stat in event.stats:
                if stat_names.get(stat.metadata_id) == "tf_op":
                    op = stat.str_value or plane.stat_metadata[
                        stat.ref_value].name
                    op_type = op.split(":")[-1]
                    ops[op_type] += ms
                    typed[(op_type, kernel_dtype(name))] += ms
                    break
    return total, kernels, ops, typed


KINDS = ("GEMM", "attention", "dropout", "LAMB", "other")


def kind_of(kernel: str, op: str = "") -> str:
    """A kernel's kind: GEMM by its name (cuBLAS, CUTLASS, XLA's GEMM
    fusions), else by the TensorFlow op (path) it ran for: dropout
    (random bits, masks), LAMB (the optimizer's update), attention (the
    attention layers' other work); else "other". An XLA fusion carries the
    path of one op it fused, so the split is approximate."""
    name, op = kernel.lower(), op.lower()
    if any(w in name for w in ("gemm", "xmma", "cutlass", "cublas",
                               "__cudnn$fmha")):
        return "GEMM" if "fmha" not in name else "attention"
    if any(w in name for w in ("xor", "philox", "rng")) or (
            "dropout" in op or "random" in op):
        return "dropout"
    if "lamb" in op or "update" in op or "/apply" in op:
        return "LAMB"
    if "attention" in op or "softmax" in op:
        return "attention"
    return "other"


def step_summary(plane, steps: int) -> dict:
    """Per step of a profile of `steps` steps: {"idle_ms", "busy_ms",
    "window_ms", kind: ms} (the window from the first event's start to the
    last one's end; busy, the union of the events on every line)."""
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    spans, kinds = [], dict.fromkeys(KINDS, 0.0)
    for line in plane.lines:
        start_ps = line.timestamp_ns * 1000
        for event in line.events:
            begin = start_ps + event.offset_ps
            spans.append((begin, begin + event.duration_ps))
            op = ""
            for stat in event.stats:
                if stat_names.get(stat.metadata_id) == "tf_op":
                    op = stat.str_value or plane.stat_metadata[
                        stat.ref_value].name
                    break
            kinds[kind_of(names.get(event.metadata_id, ""), op)] += (
                event.duration_ps / 1e9)
    if not spans:
        return {}
    spans.sort()
    busy, end = 0, spans[0][0]
    for begin, finish in spans:
        if finish > end:
            busy += finish - max(begin, end)
            end = finish
    window = (end - spans[0][0]) / 1e9
    per = max(steps, 1)
    summary = {"window_ms": window / per, "busy_ms": busy / 1e9 / per,
               "idle_ms": (window - busy / 1e9) / per}
    summary.update({kind: ms / per for kind, ms in kinds.items()})
    return summary


def profile_planes(folder: str) -> list:
    """The GPU planes of the newest profile under `folder` (else the
    host's)."""
    space = xplane_pb2.XSpace()
    with open(newest_profile(folder), "rb") as f:
        space.ParseFromString(f.read())
    planes = [p for p in space.planes if p.name.startswith("/device:GPU")]
    return planes or [p for p in space.planes if p.name == "/host:CPU"]


def _rows(counter, total, top):
    for name, ms in counter.most_common(top):
        if isinstance(name, tuple):
            name = " ".join(name)
        elif len(name) > WIDTH:
            name = name[:WIDTH - 3] + "..."
        print(f"  {ms:9.2f} ms {100 * ms / max(total, 1e-9):5.1f}%  {name}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="xplane_top", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("folder", help="where the profile was written")
    parser.add_argument("top", type=int, nargs="?", default=25,
                        help="rows a table prints (default 25)")
    parser.add_argument("--steps", type=int, default=0,
                        help="the steps the profile holds: also print idle "
                             "and kernel time by kind per step")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    top = args.top
    print(newest_profile(args.folder))
    for plane in profile_planes(args.folder):
        if args.steps:
            print(f"== {plane.name} per step: " + ", ".join(
                f"{k} {v:.2f} ms"
                for k, v in step_summary(plane, args.steps).items()))
        total, kernels, ops, typed = plane_times(plane)
        print(f"== {plane.name}: {total:.1f} ms of events, "
              f"{len(kernels)} distinct kernels")
        _rows(kernels, total, top)
        if ops:
            print("  -- by TensorFlow op type:")
            _rows(ops, total, top)
            print("  -- by TensorFlow op type and the kernel's dtype:")
            _rows(typed, total, top)


if __name__ == "__main__":
    main()
