"""Writing record shards at scale: in processes, with a progress bar, and
resumable. Shared by `build_image_records` and `create_pretraining_data`.

- `write_shard(name, records)`: a shard appears under its name only when
  complete (written hidden, renamed, then indexed for the global order).
- `Plan`: what a run will write, as a digest kept in a hidden manifest; a
  rerun with the same digest keeps the shards an earlier run completed.
- `run(tasks, fn, ...)`: calls `fn(task, progress)` for every task, in this
  process or in worker processes (spawned: TensorFlow is not fork-safe),
  with a tqdm bar fed by the workers.
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import queue as queue_lib
import sys
from typing import Callable, Iterable, List, Sequence, Set

import tensorflow as tf
import tqdm

from input_pipelines.record_order import index as record_index


def write_shard(name: str, records: Iterable[bytes],
                progress: Callable[[int], None], every: int = 16) -> int:
    """Writes serialized `records` to `name` through a hidden partial file
    (removed on failure), renames it when complete, indexes it; calls
    `progress(n)` every `every` records. Returns the record count."""
    folder, base = os.path.split(name)
    partial = os.path.join(folder, f".{base}.incomplete")
    count = pending = 0
    try:
        with tf.io.TFRecordWriter(partial) as writer:
            for record in records:
                writer.write(record)
                count += 1
                pending += 1
                if pending == every:
                    progress(pending)
                    pending = 0
    except BaseException:
        tf.io.gfile.remove(partial)
        raise
    tf.io.gfile.rename(partial, name, overwrite=True)
    if "://" not in name:
        record_index.write(name)  # the global order's offsets
    progress(pending)
    return count


def complete(name: str) -> bool:
    """A shard a finished writer left: renamed into place and indexed."""
    if "://" in name or not os.path.exists(name):
        return False
    return record_index.read_saved(name) is not None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run writes: `digest` covers everything the bytes depend on."""

    manifest: str          # hidden JSON file beside the shards
    names: Sequence[str]
    digest: str

    @staticmethod
    def digest_of(*parts) -> str:
        digest = hashlib.sha256()
        for part in parts:
            digest.update(json.dumps(part, sort_keys=True).encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def keep(self) -> Set[int]:
        """The shards an earlier run of this plan completed (none if the
        manifest is missing or another plan's); then records this plan."""
        kept = set()
        if tf.io.gfile.exists(self.manifest):
            with tf.io.gfile.GFile(self.manifest) as f:
                try:
                    same = json.load(f).get("digest") == self.digest
                except ValueError:
                    same = False
            if same:
                kept = {i for i, n in enumerate(self.names) if complete(n)}
        with tf.io.gfile.GFile(self.manifest, "w") as f:
            json.dump({"digest": self.digest, "shards": len(self.names)}, f)
        return kept


_queue = None  # in a worker process: its channel to the progress bar


def _start_worker(queue) -> None:
    global _queue
    _queue = queue


def _call(fn, task):
    return fn(task, _queue.put)


def processes_for(requested: int, tasks: int, work: int,
                  work_per_process: int) -> int:
    """Worker processes: `requested`, or for 0 one per core but no more
    than one per `work_per_process` units of work (each process imports
    TensorFlow, a few seconds); never more than tasks."""
    if requested:
        return max(1, min(requested, tasks))
    wanted = os.cpu_count() or 1
    return max(1, min(wanted, tasks, -(-work // work_per_process)))


def run(tasks: Sequence, fn: Callable, *, processes: int, total: int,
        initial: int = 0, unit: str = "record",
        show_progress: bool = False) -> List:
    """`[fn(task, progress) for task in tasks]`, with `processes` worker
    processes (1: here). `fn` must be a module-level function. A failure
    in any task cancels the rest and is raised here."""
    # disable=None: a bar on terminals only (not in logs).
    with tqdm.tqdm(total=total, initial=initial, unit=unit, desc=unit + "s",
                   disable=None if show_progress else True, smoothing=0.1,
                   file=sys.stderr, dynamic_ncols=True) as bar:
        if processes <= 1:
            return [fn(task, bar.update) for task in tasks]
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        with concurrent.futures.ProcessPoolExecutor(
                processes, mp_context=context, initializer=_start_worker,
                initargs=(queue,)) as pool:
            futures = [pool.submit(_call, fn, task) for task in tasks]
            try:
                while not all(f.done() for f in futures):
                    _drain(queue, bar, timeout=0.2)
                    for f in futures:
                        if f.done() and f.exception() is not None:
                            raise f.exception()
                _drain(queue, bar, timeout=0)
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise


def _drain(queue, bar, timeout: float) -> None:
    try:
        bar.update(queue.get(timeout=timeout) if timeout
                   else queue.get_nowait())
        while True:
            bar.update(queue.get_nowait())
    except queue_lib.Empty:
        pass
