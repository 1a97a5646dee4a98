"""What a global record position means: the record set and seed it counts in.

A checkpoint's input position q is "record perm_e(q mod n) of epoch q // n",
which holds only for the records (files, in order, and their record counts)
and the seed the permutation was made from. The Trainer saves this identity
beside the position; a resume compares it with the run's own:

  * the same: the run continues at q exactly (on any worker count);
  * another record set or seed (a shard added or removed, records rewritten,
    `--seed` changed): continuing at q would read a different permutation
    from its middle, repeating some records and skipping others. The new
    order starts instead at the first global batch at or after the start of
    the next epoch (`restart_position`), and one line says what changed.

The record set is each file's record count and content fingerprint (its
size, offsets and every record's CRC: `index.fingerprint`), in the order the
files are read: records rewritten in place with the same counts (a writer
rerun with another seed) are a change; the same files moved to another
directory or renamed, read in the same order, are not. Base names are kept
only to say what changed. A checkpoint from before fingerprints were kept
is compared by base names and counts.
"""

import json
import os
from typing import List, Sequence, Tuple


def describe(files: Sequence[str], counts: Sequence[int], seed: int,
             fingerprints: Sequence[str]) -> str:
    """The identity of an order, as the JSON text checkpoints keep:
    [base name, record count, content fingerprint] per file, and the seed."""
    return json.dumps({"seed": int(seed),
                       "files": [[os.path.basename(f), int(c), p[:32]]
                                 for f, c, p in zip(files, counts,
                                                    fingerprints)]},
                      separators=(",", ":"))


def _content(files: list, by_fingerprint: bool) -> list:
    return [(f[1], f[2]) if by_fingerprint else (f[0], f[1]) for f in files]


def num_records(identity: str) -> int:
    return sum(f[1] for f in json.loads(identity)["files"])


def changes(saved: str, current: str) -> List[str]:
    """What differs between two identities, in words (empty: the same)."""
    if saved == current:
        return []
    before, after = json.loads(saved), json.loads(current)
    fingerprinted = all(len(f) > 2 for f in before["files"] + after["files"])
    if (before["seed"] == after["seed"]
            and _content(before["files"], fingerprinted)
            == _content(after["files"], fingerprinted)):
        return []  # the same records in the same order (names aside)
    said = []
    old = {f[0]: f[1] for f in before["files"]}
    new = {f[0]: f[1] for f in after["files"]}
    added = [name for name in new if name not in old]
    removed = [name for name in old if name not in new]
    if added:
        said.append(f"{len(added)} file(s) added ({_some(added)})")
    if removed:
        said.append(f"{len(removed)} file(s) removed ({_some(removed)})")
    resized = [name for name in new if name in old and new[name] != old[name]]
    if resized:
        said.append(f"{len(resized)} file(s) with other record counts "
                    f"({_some(resized)})")
    if fingerprinted:
        old_prints = {f[0]: f[2] for f in before["files"]}
        rewritten = [f[0] for f in after["files"]
                     if f[0] in old and new[f[0]] == old[f[0]]
                     and f[2] != old_prints[f[0]]]
        if rewritten:
            said.append(f"{len(rewritten)} file(s) rewritten with the same "
                        f"record counts ({_some(rewritten)})")
    if not said and before["seed"] == after["seed"]:
        said.append("the files in another order")
    records_before, records_after = sum(old.values()), sum(new.values())
    if records_before != records_after:
        said.append(f"records {records_before} -> {records_after}")
    if before["seed"] != after["seed"]:
        said.append(f"seed {before['seed']} -> {after['seed']}")
    return said or ["the record set"]


def restart_position(saved: str, position: int, current: str,
                     global_batch_size: int) -> Tuple[int, int]:
    """(where the new order starts, its epoch): the first global batch at
    or after the start of the epoch that follows the saved position's.

    Positions count records across epochs; the saved position's epochs are
    of the saved record set, the new ones of the current set.
    """
    old_n, new_n = num_records(saved), num_records(current)
    epoch = -(-int(position) // max(1, old_n))  # epochs begun so far
    start = epoch * new_n
    start = -(-start // global_batch_size) * global_batch_size
    return start, start // max(1, new_n)


def _some(names: Sequence[str], shown: int = 3) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
