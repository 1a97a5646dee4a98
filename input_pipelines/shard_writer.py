"""Writing record shards exactly once, resumably. Shared by
`build_image_records` and `create_pretraining_data` (their tasks run where
`prepare/engine.py` says: here, a local Dask cluster or a remote one).

- `write_shard(name, records)`: a shard appears under its name only when
  complete: written under a temporary name of its own attempt, renamed
  into place, then indexed (the index is the commit mark: `complete`). Two
  attempts at one shard (a retry after a worker died, or both at once)
  write the same bytes, and the last rename wins with them.
- `Plan`: what a run will write, as a digest kept in a hidden manifest; a
  rerun with the same digest keeps the shards an earlier run completed. A
  rerun with another digest removes the earlier shards, but only once it
  knows it can finish: never another user's files (a shared folder), and
  never before the folder is known writable (`OutputError`, one line); the
  manifest is replaced whole (a temporary file renamed), never rewritten
  in place.
- `remove_leftovers(names)`: the temporary files of attempts that died.
"""

import dataclasses
import glob
import hashlib
import json
import os
import pwd
import sys
import tempfile
import uuid
from typing import Callable, Iterable, Sequence, Set

import tensorflow as tf

from input_pipelines.record_order import index as record_index


def write_shard(name: str, records: Iterable[bytes],
                progress: Callable[[int], None], every: int = 16) -> int:
    """Writes serialized `records` to `name` through a hidden file of this
    attempt's own (removed on failure), renames it when complete, indexes
    it; calls `progress(n)` every `every` records. Returns the record
    count."""
    folder, base = os.path.split(name)
    partial = os.path.join(folder, f".{base}.{uuid.uuid4().hex}.incomplete")
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
        try:
            record_index.write(name)  # the global order's offsets
        except PermissionError:
            pass  # another user's index folder: readers index it themselves
    progress(pending)
    return count


def complete(name: str) -> bool:
    """A shard a finished writer left: renamed into place and indexed."""
    if "://" in name or not os.path.exists(name):
        return False
    return record_index.read_saved(name) is not None


class OutputError(ValueError):
    """The output cannot be written as planned; the message, one line,
    names the file or folder."""


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _check_replaceable(folder: str, paths: Sequence[str]) -> None:
    """Raises `OutputError` unless this user can remove every file of
    `paths` and write new ones in `folder`: checked before anything is
    removed, so a refused rerun leaves the earlier run's output whole."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{folder}: this user cannot write there: write "
                          "the output to a folder you can write")
    me = os.geteuid()
    for path in paths:
        uid = os.stat(path).st_uid
        if uid != me:
            raise OutputError(
                f"{path}: an earlier run with other settings wrote it, and "
                f"it belongs to {_owner(uid)}: this run would replace it, "
                "and does not remove another user's files; remove them, "
                "or write to another output")


def _write_manifest(path: str, content: dict) -> None:
    """The manifest, whole or not at all: a temporary file renamed over
    it (unchanged: left alone, which also keeps another user's file)."""
    data = json.dumps(content)
    if "://" in path:
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(data)
        return
    try:
        with open(path) as f:
            if f.read() == data:
                return
    except OSError:
        pass
    folder, base = os.path.split(path)
    fd, partial = tempfile.mkstemp(prefix=f"{base}.", suffix=".partial",
                                   dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


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

    def keep(self, say: Callable[[str], None] = lambda line: print(
            line, file=sys.stderr)) -> Set[int]:
        """The shards an earlier run of this plan completed. Shards of
        another plan (an earlier run with other settings, or with no
        manifest to say which) are removed first, with their indexes, and
        `say` gets one line naming them: a run killed mid-way and rerun
        never mixes two plans' shards. Then records this plan. Call it
        holding the output's claim (`output_claim`).

        Raises:
            OutputError: An earlier plan's file this user may not remove
                (another user's), or a folder it cannot write: nothing
                removed.
        """
        earlier = None
        if tf.io.gfile.exists(self.manifest):
            with tf.io.gfile.GFile(self.manifest) as f:
                try:
                    earlier = json.load(f).get("digest")
                except ValueError:
                    earlier = "unreadable"
        kept = set()
        if earlier == self.digest:
            kept = {i for i, n in enumerate(self.names) if complete(n)}
        else:
            removed = [name for name in self.names
                       if "://" not in name and os.path.exists(name)]
            doomed = [path for name in self.names if "://" not in name
                      for path in (name, record_index.index_path(name),
                                   record_index.fingerprint_path(name))
                      if os.path.exists(path)]
            if "://" not in self.manifest:
                _check_replaceable(os.path.dirname(self.manifest) or ".",
                                   doomed + ([self.manifest] if earlier
                                             else []))
            if removed:
                said = ("no manifest" if earlier is None
                        else f"plan {str(earlier)[:16]}")
                whole = sum(complete(name) for name in removed)
                say(f"removing {len(removed)} shard(s) ({whole} complete) of "
                    f"an earlier run with other settings ({said}; this run's "
                    f"plan {self.digest[:16]}): "
                    + ", ".join(os.path.basename(n) for n in removed[:3])
                    + (", ..." if len(removed) > 3 else ""))
            for path in doomed:
                os.remove(path)
        _write_manifest(self.manifest, {"digest": self.digest,
                                        "shards": len(self.names)})
        return kept


def other_shards(pattern: str, names: Sequence[str]) -> list:
    """Files `pattern` (`NAME-*-of-*`) matches that are not `names`: shards
    of an earlier run with another shard count, which a glob of the data
    set would read too (a silent duplicate of the data)."""
    def absolute(path):
        return path if "://" in path else os.path.abspath(path)
    ours = {absolute(n) for n in names}
    return sorted(p for p in tf.io.gfile.glob(pattern)
                  if absolute(p) not in ours)


def remove_leftovers(names: Sequence[str]) -> int:
    """Removes the temporary files that attempts at `names` left (a worker
    killed mid-shard); call it when no attempt is running. Returns how many."""
    removed = 0
    for name in names:
        if "://" in name:
            continue
        folder, base = os.path.split(name)
        hidden = os.path.join(glob.escape(folder), f".{glob.escape(base)}")
        # And its index's and fingerprint's (`record_index.write`).
        index = [glob.escape(record_index.index_path(name)),
                 glob.escape(record_index.fingerprint_path(name))]
        for leftover in (glob.glob(hidden + ".*.incomplete")
                         + glob.glob(hidden + ".incomplete")
                         + [p for stem in index
                            for p in glob.glob(stem + ".*.partial")]):
            os.remove(leftover)
            removed += 1
    return removed
