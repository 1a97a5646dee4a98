r"""Where a profile's device time went: TensorFlow's profile (`.xplane.pb`)
summed by kernel and by TensorFlow op, per device, with no TensorBoard.

    python run_pretraining.py ... --iterations_per_loop=1 --profile_steps=24,26
    python -m benchmarks.xplane_top runs/bert [TOP]

Reads the newest `.xplane.pb` under the folder (the TensorBoard callback
writes it under `<output_dir>/.../plugins/profile/<run>/`). For each GPU
plane: the total of its events' durations, the TOP kernels by time, and the
same time grouped by the TensorFlow op each kernel ran for (the `tf_op`
stat: `name:type`, grouped by type), each with its share. On a machine with
no GPU it sums the host's TensorFlow op events instead ("/host:CPU").
"""

import collections
import glob
import os
import sys

from tensorflow.tsl.profiler.protobuf import xplane_pb2


def newest_profile(folder: str) -> str:
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"),
                      recursive=True)
    if not files:
        sys.exit(f"xplane_top: no .xplane.pb under {folder}")
    return max(files, key=os.path.getmtime)


def plane_times(plane):
    """(total ms, Counter of kernel -> ms, Counter of op type -> ms)."""
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    kernels, ops = collections.Counter(), collections.Counter()
    total = 0.0
    for line in plane.lines:
        for event in line.events:
            ms = event.duration_ps / 1e9
            kernels[names.get(event.metadata_id, "?")[:90]] += ms
            total += ms
            for stat in event.stats:
                if stat_names.get(stat.metadata_id) == "tf_op":
                    op = stat.str_value or plane.stat_metadata[
                        stat.ref_value].name
                    ops[op.split(":")[-1]] += ms
                    break
    return total, kernels, ops


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(__doc__)
    top = int(argv[1]) if len(argv) > 1 else 25
    path = newest_profile(argv[0])
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    planes = [p for p in space.planes if p.name.startswith("/device:GPU")]
    if not planes:
        planes = [p for p in space.planes if p.name == "/host:CPU"]
    print(path)
    for plane in planes:
        total, kernels, ops = plane_times(plane)
        print(f"== {plane.name}: {total:.1f} ms of events")
        for name, ms in kernels.most_common(top):
            print(f"  {ms:9.2f} ms {100 * ms / max(total, 1e-9):5.1f}%  {name}")
        if ops:
            print("  -- by TensorFlow op type:")
            for name, ms in ops.most_common(top):
                print(f"  {ms:9.2f} ms {100 * ms / max(total, 1e-9):5.1f}%  "
                      f"{name}")


if __name__ == "__main__":
    main()
