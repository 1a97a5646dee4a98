"""Files that survive a kill and a power cut: written beside, flushed to
disk, renamed into place, the folder flushed; a write that fails names its
path, and a full disk says so (`errors.DiskFull`, not restarted).

A rename is atomic for other processes, but without `fsync` a crash of the
machine can leave the new name pointing at a file whose data never reached
the disk. `replace(partial, final)` is the one way this project commits a
finished file: flush its data, rename it over `final`, flush the folder
(the rename itself).
"""

import errno
import os
import shutil
import uuid
from typing import Callable, Optional

from tfscale.errors import DiskFull

# What an error says when the disk (or the user's quota) is full: errno
# ENOSPC or EDQUOT, or TensorFlow's and HDF5's text of them.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("No space left on device", "Disk quota exceeded",
              "[Errno 28]", "errno = 28")


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
    hidden file is removed when anything fails.

    Raises:
        DiskFull: The disk is full (the folder and what is free named).
        OSError: Another failed write, its message naming `final`.
    """
    partial = hidden_name(final)
    try:
        write(partial)
        replace(partial, final)
    except BaseException as e:
        if os.path.exists(partial):
            os.remove(partial)
        if isinstance(e, OSError) and not isinstance(e, DiskFull):
            raise write_error(final, e) from None
        raise


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (an OSError, TensorFlow's ResourceExhaustedError,
    HDF5's) says the disk or quota is full."""
    if getattr(error, "errno", None) in _FULL_ERRNOS:
        return True
    return any(text in str(error) for text in _FULL_TEXT)


def free_bytes(folder: str) -> Optional[int]:
    """Bytes free to this user in `folder`'s file system (None: not a
    local folder, e.g. gs://)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def size_text(count: Optional[int]) -> str:
    """"2.1 MB" (decimal units, as `df -H`)."""
    if count is None:
        return "an unknown amount"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count} B"
        count /= 1000
    raise AssertionError("unreachable")


def write_error(path: str, error: OSError) -> OSError:
    """`error` as one line naming `path`: `DiskFull` (with the bytes
    free) when the disk is full, else an OSError of the same errno."""
    reason = error.strerror or str(error) or type(error).__name__
    if is_disk_full(error):
        return DiskFull(
            f"cannot write {path}: the disk is full "
            f"({size_text(free_bytes(os.path.dirname(path) or '.'))} free "
            f"in {os.path.dirname(path) or '.'}); free space or write "
            "elsewhere")
    return OSError(error.errno, f"cannot write {path}: {reason}")
