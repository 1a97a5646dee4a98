"""The training state: what a checkpoint holds, how it is saved and restored.

A training checkpoint is the whole run:

    model        every model variable, trainable or not, under the names
                 TensorFlow's object graph gives them (so
                 `tf.train.Checkpoint(model=model).restore(path)` alone
                 restores every weight);
    model_extra  model weights that object graph cannot see (layers a
                 subclassed model keeps in a plain list or dict), in
                 `model.weights` order;
    rng          the state of every Keras `SeedGenerator` in the model
                 (Dropout's masks): Keras does not put them in the object
                 graph, and without them a resumed run replays step 0's masks;
    optimizer, step, loss_scale, metrics;
    input_position  records the run has consumed: a positioned input (the
                 global record order) resumes there, on any worker count;
    input_order  what that position counts in (the record set and seed,
                 `input_pipelines/record_order/identity.py`): a resume on
                 other records or another seed starts the new order at its
                 next epoch instead of in the middle of a different one;
    input        for other inputs, one file per worker: the state of its
                 tf.data iterator (file offsets, shuffle buffers, prefetched
                 batches), so a resume on the same worker count neither
                 re-reads nor skips a record;
    noise_scale, adascale  the gradient noise scale's moving averages and
                 AdaScale's gain and progress (`noise/scale.py`).

The chief writes the main checkpoint; every worker writes its own input
state under `input/worker-<i>-of-<n>/` in the same (shared) directory. Each
worker writes its input state *before* a barrier and the chief updates the
`checkpoint` index only after it, so a checkpoint is "latest" only when every
worker's part is on disk: a checkpoint being written when a worker dies never
becomes latest (TensorFlow also writes the index after the data files).

Restoring checks every variable against the checkpoint first, and an
incompatible checkpoint (another model size or vocabulary) is one error
naming the first mismatched variable and both shapes, never a partial load.
"""

import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import keras
import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tfscale import durable
from tfscale.errors import DiskFull


class RestoreError(ValueError):
    """A checkpoint does not fit the objects it is restored into."""


# ---- what the object graph sees ------------------------------------------------


def _children(obj) -> Dict[str, object]:
    return dict(tf.train.TrackableView.children(obj))


def _variables_by_path(root, skip=()) -> Dict[Tuple[str, ...], object]:
    """Every variable reachable from `root`, keyed by its object-graph path
    (not looking inside objects of the types in `skip`)."""
    found, seen = {}, set()
    queue = [((), root)]
    while queue:
        path, obj = queue.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if _is_variable(obj):
            found[path] = obj
            continue
        for name, child in _children(obj).items():
            if not isinstance(child, skip):
                queue.append((path + (name,), child))
    return found


def _is_variable(obj) -> bool:
    return isinstance(obj, tf.Variable) or (
        hasattr(obj, "_value") and hasattr(obj, "path") and
        hasattr(obj, "assign") and hasattr(obj, "shape"))


def unreachable_weights(model) -> list:
    """Model weights that `tf.train.Checkpoint(model=model)` would not save.

    Layers held in a plain Python list or dict of a subclassed Keras 3 model
    are tracked by Keras but not by TensorFlow's object graph (docs/facts.md,
    fact 14).
    """
    holder = tf.train.Checkpoint(model=model)
    # Not through the optimizer (`compile` or the Trainer hang it on the
    # model): it references the trainable variables, but a model restored
    # without one would not find them there.
    reachable = {id(v) for v in _variables_by_path(
        holder, skip=(keras.optimizers.Optimizer,)).values()}
    return [v for v in model.weights if id(v) not in reachable]


def seed_states(model) -> list:
    """The state variables of every Keras `SeedGenerator` in the model."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _key(path) -> str:
    return "/".join(path)


# ---- checking a checkpoint before restoring it ---------------------------------


class CorruptCheckpoint(RestoreError):
    """A checkpoint's files do not read: a checksum that does not match, a
    data file missing or cut short (`why`: TensorFlow's first line)."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} is corrupt ({why})")
        self.path, self.why = path, why


def _first_line(error: Exception) -> str:
    """TensorFlow's error in a few words: "Checksum does not match", or its
    first line without the op's name, up to 160 characters."""
    import re
    text = str(getattr(error, "message", "") or error).strip()
    if "Checksum does not match" in text:
        return "Checksum does not match"
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    line = (text.splitlines() or [type(error).__name__])[0]
    return line if len(line) <= 160 else line[:157] + "..."


# What reading a damaged checkpoint raises: a tensor's checksum
# (DataLossError), a data shard missing (NotFoundError) or cut short.
_DAMAGE = (tf.errors.DataLossError, tf.errors.NotFoundError,
           tf.errors.OutOfRangeError, tf.errors.FailedPreconditionError)


def _checkpoint_graph(path: str):
    try:
        reader = tf.train.load_checkpoint(path)
    except _DAMAGE as e:
        if tf.io.gfile.exists(path + ".index"):
            raise CorruptCheckpoint(path, _first_line(e)) from None
        raise RestoreError(f"no checkpoint at {path}") from None
    except (tf.errors.OpError, ValueError):
        raise RestoreError(f"no checkpoint at {path}") from None
    if not reader.has_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"):
        raise RestoreError(
            f"{path} is a name-based (TF1) checkpoint, such as Google's "
            f"bert_model.ckpt; tfscale reads object-based (TF2) checkpoints "
            f"only")
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    return graph, reader.get_variable_to_shape_map()


def verify_whole(path: str) -> None:
    """Reads every tensor of the checkpoint at `path` through its own
    reader, which checks each one's checksum (nothing is restored: a
    failed restore half-way would leave the variables half-assigned).

    Raises:
        CorruptCheckpoint: A checksum does not match, a data file is
            missing or short (the first one met, in TensorFlow's words).
    """
    try:
        reader = tf.train.load_checkpoint(path)
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    except (tf.errors.OpError, RuntimeError) as e:  # the reader's: OpError
        raise CorruptCheckpoint(path, _first_line(e)) from None


def checkpoint_step(path: Optional[str]) -> int:
    """The training step a tfscale checkpoint was written at (0 if none)."""
    if not path:
        return 0
    reader = tf.train.load_checkpoint(path)
    key = "step/.ATTRIBUTES/VARIABLE_VALUE"
    return int(reader.get_tensor(key)) if reader.has_tensor(key) else 0


def check_restorable(root, path: str, *, optional: Tuple[str, ...] = ()):
    """Raises RestoreError unless every variable under `root` is in the
    checkpoint at `path` with the same shape.

    Args:
        root: The object restored into (e.g. a `tf.train.Checkpoint`).
        path: A checkpoint prefix.
        optional: Top-level names that may be absent from the checkpoint.
    """
    graph, shapes = _checkpoint_graph(path)
    for var_path, variable in _variables_by_path(root).items():
        node = graph.nodes[0]
        missing = False
        for name in var_path:
            ids = {c.local_name: c.node_id for c in node.children}
            if name not in ids:
                missing = True
                break
            node = graph.nodes[ids[name]]
        if missing:
            if var_path[0] in optional:
                continue
            raise RestoreError(
                f"checkpoint {path} has no value for {_key(var_path)} "
                f"(shape {list(variable.shape)}): it was written by another "
                f"model")
        keys = [a.checkpoint_key for a in node.attributes
                if a.name == "VARIABLE_VALUE"]
        if keys and keys[0] in shapes and list(shapes[keys[0]]) != list(
                variable.shape):
            raise RestoreError(
                f"checkpoint {path}: {_key(var_path)} has shape "
                f"{list(shapes[keys[0]])} in the checkpoint but "
                f"{list(variable.shape)} in the model")


def restore_model(model, path: str) -> str:
    """Restores every weight of `model` from a training checkpoint (or a
    checkpoint of `tf.train.Checkpoint(model=...)`).

    `path` may be a checkpoint prefix or a directory (its latest checkpoint).

    Raises:
        RestoreError: No checkpoint there, or it does not fit the model.
    """
    if tf.io.gfile.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise RestoreError(f"no checkpoint in directory {path}")
        path = latest
    holder = tf.train.Checkpoint(model=model)
    check_restorable(holder, path)
    holder.restore(path).expect_partial().assert_existing_objects_matched()
    return path


# ---- the keeper ------------------------------------------------------------------


def input_dir(directory: str, worker_index: int, num_workers: int) -> str:
    return os.path.join(directory, "input",
                        f"worker-{worker_index}-of-{num_workers}")


class CheckpointKeeper:
    """Saves and restores the whole training state.

    Args:
        directory: The chief's checkpoint directory (shared by all workers).
        is_chief: Whether this worker writes the main checkpoint.
        worker_index: This worker's index.
        num_workers: Number of workers.
        barrier_fn: Called by every worker between writing its input state
            and the main checkpoint (a collective); None with one worker.
        max_to_keep: How many checkpoints to keep.
        **trackables: The main checkpoint's contents (model=..., ...).
    """

    def __init__(self, directory: str, *, is_chief: bool, worker_index: int = 0,
                 num_workers: int = 1, barrier_fn: Optional[Callable] = None,
                 max_to_keep: int = 5, **trackables):
        self.directory = directory
        self._checkpoint = tf.train.Checkpoint(**trackables)
        self._is_chief = is_chief
        self._barrier_fn = barrier_fn
        self._max_to_keep = max_to_keep
        self._input_dir = input_dir(directory, worker_index, num_workers)
        self._input_manager = None
        self._input_checkpoint = None
        if is_chief:
            write_dir = directory
            self._private_dir = None
            remove_unfinished_saves(directory)
        else:
            self._private_dir = tempfile.mkdtemp(prefix="tfscale-ckpt-")
            write_dir = self._private_dir
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, write_dir, max_to_keep=max_to_keep)

    @property
    def latest(self) -> Optional[str]:
        """The newest complete checkpoint in the chief's directory."""
        return tf.train.latest_checkpoint(self.directory)

    def restore_latest(self, say: Callable[[str], None] = None
                       ) -> Optional[str]:
        """Restores the newest whole checkpoint, if any; returns its path.

        A newer one whose files do not read (`verify_whole`: a checksum
        that does not match, a missing or short data file; every tensor is
        read once more for it) is passed over, named in one line (`say`), and the chief moves its files aside into
        `ckpt-N.corrupt/` (never deletes them) and points the directory's
        `checkpoint` file at the one restored.

        Raises:
            RestoreError: The checkpoint does not fit (another model), or
                every checkpoint is corrupt (`CorruptCheckpoint`).
        """
        passed = []
        for path in self._newest_first():
            try:
                verify_whole(path)
            except CorruptCheckpoint as e:
                passed.append((path, e.why, self._move_aside(path)))
                continue
            check_restorable(self._checkpoint, path,
                             optional=("loss_scale", "metrics", "rng",
                                       "model_extra", "input_position",
                                       "input_order", "run_settings",
                                       "noise_scale", "adascale"))
            self._checkpoint.restore(path).expect_partial()
            if passed:
                self._forget(passed, path)
                (say or _warn)(_passed_over(passed) + f"; resumed from {path}")
            return path
        if passed:
            raise RestoreError(
                f"{self.directory}: " + _passed_over(passed) + "; no whole "
                "checkpoint is left to resume from: restore one from a copy, "
                "or remove the folder to start over")
        return None

    def _newest_first(self) -> List[str]:
        """The directory's checkpoints, newest first."""
        state = tf.train.get_checkpoint_state(self.directory)
        if state is None:
            return []
        paths = list(state.all_model_checkpoint_paths) or [
            state.model_checkpoint_path]
        paths = [p if os.path.isabs(p) else os.path.join(self.directory, p)
                 for p in paths]
        return sorted(set(paths), key=checkpoint_number, reverse=True)

    def _move_aside(self, path: str) -> Optional[str]:
        """The chief moves `path`'s files into `path.corrupt/`; the folder
        (None elsewhere)."""
        if not self._is_chief:
            return None
        aside = path + ".corrupt"
        os.makedirs(aside, exist_ok=True)
        for name in tf.io.gfile.glob(path + ".*"):
            if name != aside:
                os.replace(name, os.path.join(aside, os.path.basename(name)))
        return aside

    def _forget(self, passed, restored: str) -> None:
        """The chief's `checkpoint` file names `restored` as the latest, and
        no longer the checkpoints passed over."""
        if not self._is_chief:
            return
        gone = {p for p, _, _ in passed}
        kept = [p for p in reversed(self._newest_first()) if p not in gone]
        tf.compat.v1.train.update_checkpoint_state(
            self.directory, restored, all_model_checkpoint_paths=kept)

    def track_input(self, iterator) -> None:
        """This worker's tf.data iterator, saved with every checkpoint."""
        remove_unfinished_saves(self._input_dir)
        self._input_checkpoint = tf.train.Checkpoint(iterator=iterator)
        self._input_manager = tf.train.CheckpointManager(
            self._input_checkpoint, self._input_dir,
            max_to_keep=self._max_to_keep)

    def untrack_input(self) -> None:
        """Forgets the iterator after `fit` (the feed then deletes it)."""
        self._input_checkpoint = None
        self._input_manager = None

    def restore_input(self, step: int) -> Optional[str]:
        """Restores this worker's input position saved at `step`.

        Returns:
            The input checkpoint's path, or None when there is none for this
            worker count (first start, another worker count, or a run
            restored from BackupAndRestore): the input then starts over.

        Raises:
            RestoreError: The saved state does not fit this input pipeline.
        """
        prefix = os.path.join(self._input_dir, f"ckpt-{step}")
        if self._input_checkpoint is None or not tf.io.gfile.exists(
                prefix + ".index"):
            return None
        try:
            self._input_checkpoint.restore(prefix).assert_consumed()
        except (tf.errors.OpError, AssertionError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise RestoreError(
                f"input state {prefix} does not fit this input pipeline "
                f"({type(e).__name__}: {first[:200]}); remove "
                f"{os.path.dirname(self._input_dir)} to start the input "
                f"over") from None
        return prefix

    def save(self, step: int) -> Optional[str]:
        """Saves at `step` (every worker calls it); returns the chief's path.

        Order: input state (every worker) -> barrier -> main checkpoint
        (the chief's index is updated last).
        """
        check_room(self._manager.directory, self._manager.latest_checkpoint,
                   step)
        try:
            if self._input_manager is not None:
                self._input_manager.save(checkpoint_number=step)
            if self._barrier_fn is not None:
                self._barrier_fn()
            path = self._manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            if not durable.is_disk_full(e):
                raise
            remove_unfinished_saves(self._manager.directory)
            raise full_disk(self._manager.directory,
                            self._manager.latest_checkpoint, step) from None
        return path if self._is_chief else None

    def chief_path(self, step: int) -> str:
        """The chief's checkpoint of `step` (what every worker's save of
        `step` is part of)."""
        return os.path.join(self.directory, f"ckpt-{step}")

    def close(self):
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def checkpoint_bytes(prefix: Optional[str]) -> int:
    """Bytes of the checkpoint `prefix` on disk (its index and data
    files); 0 for None or a remote path that cannot be listed."""
    if not prefix:
        return 0
    try:
        return sum(os.path.getsize(p) for p in tf.io.gfile.glob(prefix + ".*")
                   if os.path.isfile(p))
    except (OSError, tf.errors.OpError):
        return 0


def check_room(directory: str, last: Optional[str], step: int) -> None:
    """Before checkpoint `step` is written: raises `DiskFull` when the
    folder's file system has less room than the last checkpoint took (a
    statvfs and a listing; nothing for the first save or a remote path).
    """
    free = durable.free_bytes(directory)
    if last and free is not None and free < checkpoint_bytes(last):
        raise full_disk(directory, last, step)


def full_disk(directory: str, last: Optional[str], step: int) -> DiskFull:
    """The one line for a checkpoint that has no room: the folder, what
    the last one took, what is free."""
    took = (f"the last one ({os.path.basename(last)}) took "
            f"{durable.size_text(checkpoint_bytes(last))}, " if last else "")
    return DiskFull(
        f"no room for checkpoint ckpt-{step} in {directory}: {took}"
        f"{durable.size_text(durable.free_bytes(directory))} free; free "
        "space there (the checkpoints before it are whole) or give another "
        "checkpoint folder (--output_dir, TrainConfig.checkpoint_dir)")


def _warn(line: str) -> None:
    from absl import logging
    logging.warning("tfscale: %s", line)


def checkpoint_number(path: str) -> int:
    """N of a `.../ckpt-N` prefix (-1 when it has none)."""
    tail = path.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _passed_over(passed) -> str:
    """"ckpt-600 is corrupt (Checksum does not match): moved to
    ckpt-600.corrupt" for each checkpoint passed over."""
    return "; ".join(
        f"{os.path.basename(p)} is corrupt ({why})" + (
            f": moved to {os.path.basename(aside)}" if aside else "")
        for p, why, aside in passed)


def remove_unfinished_saves(directory: str) -> List[str]:
    """Removes what saves killed mid-way left in `directory`: TensorFlow
    writes a checkpoint's shards into `PREFIX_temp/` and merges them into
    place, so a save killed (kill -9, a scheduler's SIGKILL) leaves that
    folder, never a half checkpoint. Call it where one writer writes,
    before it saves; returns what it removed."""
    removed = []
    for path in tf.io.gfile.glob(os.path.join(directory, "ckpt-*_temp")):
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
            removed.append(path)
    return removed


def training_trackables(model, optimizer, step, *, loss_scale=None,
                        metrics=(), input_position=None,
                        input_order=None, run_settings=None,
                        noise_scale=None, adascale=None) -> dict:
    """What a training checkpoint holds (see the module docstring)."""
    trackables = dict(model=model, optimizer=optimizer, step=step)
    # The gradient noise scale's EMAs and AdaScale's gain and progress
    # ({name: variable}): a resume continues them.
    for name, value in (("noise_scale", noise_scale),
                        ("adascale", adascale)):
        if value:
            trackables[name] = dict(value)
    if input_position is not None:
        trackables["input_position"] = input_position
    if input_order is not None:
        trackables["input_order"] = input_order
    if run_settings is not None:
        trackables["run_settings"] = run_settings
    extra = unreachable_weights(model)
    if extra:
        names = ", ".join(v.path for v in extra[:3])
        logging.warning(
            "tfscale: %d model weight(s) are invisible to TensorFlow's "
            "checkpoint object graph (layers kept in a plain list or dict?), "
            "e.g. %s; the training checkpoint tracks them by path, but "
            "tf.train.Checkpoint(model=model) alone will not restore them: "
            "assign each layer to its own attribute", len(extra), names)
        # By position in `model.weights`: Keras paths carry process-wide
        # uniquified names (dense_2), which need not match on restore.
        trackables["model_extra"] = list(extra)
    rng = seed_states(model)
    if rng:
        trackables["rng"] = list(rng)
    metric_variables = [v for m in metrics for v in m.variables]
    if metric_variables:
        trackables["metrics"] = metric_variables
    if loss_scale is not None:
        trackables["loss_scale"] = loss_scale
    return trackables


def input_state_steps(directory: str, worker_index: int,
                      num_workers: int) -> List[int]:
    """Steps at which this worker's input state was saved (for tests/tools)."""
    prefix = os.path.join(input_dir(directory, worker_index, num_workers),
                          "ckpt-")
    steps = []
    for name in tf.io.gfile.glob(prefix + "*.index"):
        steps.append(int(name[len(prefix):-len(".index")]))
    return sorted(steps)
