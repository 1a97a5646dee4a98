r"""Two runs' final weights compared: the largest difference relative to
each tensor's largest value, and whether every tensor is bit-identical.

    python -m tfscale.resume.compare RUN_A RUN_B    # prints one JSON line

Each run is an output folder (`--output_dir`: its latest checkpoint under
`checkpoints/`), a checkpoint folder, or a checkpoint path (`.../ckpt-300`);
the model's weights and the optimizer's slots are compared (`weights`). The
invariants' check: N workers against 1 at one global batch, a resumed run
against an uninterrupted one. Exit 0 when both could be read, 2 when one
could not (named).
"""

import json
import os
import sys

import numpy as np


# A tensor whose largest value is below this is compared against it, not
# against its own scale: an attention's key bias, whose gradient is zero in
# exact arithmetic, holds rounding noise of 1e-10 that differs from run to
# run and would read as a 100% difference.
SCALE_FLOOR = 1e-4


def checkpoint_path(run: str) -> str:
    """The checkpoint `run` names (an output folder, a checkpoint folder or
    a checkpoint's path).

    Raises:
        FileNotFoundError: None there (the message names `run`).
    """
    import tensorflow as tf
    if os.path.exists(run + ".index"):
        return run
    for folder in (os.path.join(run, "checkpoints"), run):
        found = tf.train.latest_checkpoint(folder)
        if found:
            return found
    raise FileNotFoundError(f"{run}: no checkpoint there (nor under "
                            f"{os.path.join(run, 'checkpoints')})")


def weights(run: str) -> dict:
    """{key: array} of the model's weights and the optimizer's slots in
    `run`'s checkpoint: every floating-point tensor under `model/` and
    `optimizer/` (a checkpoint saves each variable once, at the first path
    that reaches it: most of a model's weights sit under
    `optimizer/_trainable_variables/`)."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(checkpoint_path(run))
    kinds = reader.get_variable_to_dtype_map()
    return {k: reader.get_tensor(k) for k in kinds
            if k.startswith(("model/", "optimizer/"))
            and kinds[k].is_floating}


def compare(a: dict, b: dict) -> dict:
    """{"max_relative_difference", "bit_identical", "tensors"} of two
    `weights` with the same keys: the largest difference of any tensor
    relative to its largest value (at least `SCALE_FLOOR`).

    Raises:
        ValueError: The keys or a shape differ (named).
    """
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))[:3]
        raise ValueError(f"the runs hold different weights: {missing}")
    worst = 0.0
    for key in a:
        if a[key].shape != b[key].shape:
            raise ValueError(f"{key}: shape {a[key].shape} against "
                             f"{b[key].shape}")
        x = np.asarray(a[key], np.float64)
        y = np.asarray(b[key], np.float64)
        if x.size:
            scale = max(float(np.max(np.abs(x))), SCALE_FLOOR)
            worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return {"max_relative_difference": worst,
            "bit_identical": all(np.array_equal(a[k], b[k]) for k in a),
            "tensors": len(a)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        result = compare(weights(argv[0]), weights(argv[1]))
    except (FileNotFoundError, ValueError) as e:
        print(f"tfscale.resume.compare: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
