"""What a worker's memory holds: its peak resident size, read from Linux.

`peak_resident_bytes` is VmHWM of /proc/self/status: the most physical
memory the process has held at once (the number a cgroup or SLURM's
--mem limit is checked against), including TensorFlow's CPU allocator.
On a GPU the device's memory is another budget (`tf.config.experimental.
get_memory_info`).
"""

from typing import Optional


def peak_resident_bytes(status: str = "/proc/self/status") -> Optional[int]:
    """This process's peak resident set (VmHWM), or None where the kernel
    does not report it (not Linux)."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024}.get(unit, 1)
    except OSError:
        return None
    return None
