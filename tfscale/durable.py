"""Files that survive a kill and a power cut: written beside, flushed to
disk, renamed into place, the folder flushed.

A rename is atomic for other processes, but without `fsync` a crash of the
machine can leave the new name pointing at a file whose data never reached
the disk. `replace(partial, final)` is the one way this project commits a
finished file: flush its data, rename it over `final`, flush the folder
(the rename itself).
"""

import os


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
