"""Files that survive a kill and a power cut: written beside, flushed to
disk, renamed into place, the folder flushed.

A rename is atomic for other processes, but without `fsync` a crash of the
machine can leave the new name pointing at a file whose data never reached
the disk. `replace(partial, final)` is the one way this project commits a
finished file: flush its data, rename it over `final`, flush the folder
(the rename itself).
"""

import os
import uuid
from typing import Callable


def flush_file(path: str) -> None:
    """Flushes `path`'s data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flush_folder(folder: str) -> None:
    """Flushes `folder`'s entries (renames, new names) to disk; a file
    system that cannot (some network ones) is left as it is."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace(partial: str, final: str) -> None:
    """Commits the finished file `partial` as `final`: flushed, renamed,
    the folder flushed."""
    flush_file(partial)
    os.replace(partial, final)
    flush_folder(os.path.dirname(final))


def hidden_name(final: str) -> str:
    """A hidden name of one attempt's own beside `final` (the base name
    stays last: Keras's save_weights wants one ending in .weights.h5)."""
    folder, base = os.path.split(final)
    return os.path.join(folder, f".{uuid.uuid4().hex}.{base}")


def commit(write: Callable[[str], None], final: str) -> None:
    """`write(path)` into a hidden file, then `replace` it as `final`; the
    hidden file is removed when anything fails."""
    partial = hidden_name(final)
    try:
        write(partial)
        replace(partial, final)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
