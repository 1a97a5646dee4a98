"""Whether XLA compiles the step (`choose`: `--xla`'s auto default), and
XLA_FLAGS for it: XLA's GEMMs on cuBLAS, its autotuning cached.

`--xla` is auto by default: on where the worker's devices are GPUs (the
BERT-base step is one XLA program there, `step/train_step.py`), off on CPUs, where
XLA's CPU code is slower for BERT than TensorFlow's oneDNN kernels
(benchmarks/README.md); `--xla` and `--noxla` force it.

TensorFlow 2.21's XLA hands every GEMM of a GPU step to a Triton kernel:
at `--xla_gpu_autotune_level=0` one untuned tiling, at the default level
after timing many Triton configurations per GEMM (minutes of compilation).
cuBLAS is only a candidate of that autotuning. `--xla_gemm=cublas` (the
default) sets `--xla_gpu_enable_triton_gemm=false`, which sends GEMMs to
cuBLAS with its cheap algorithm choice; `triton` leaves XLA's own choice.
Autotuning results persist in `<output_dir>/xla_autotune`
(`--xla_gpu_per_fusion_autotune_cache_dir`; XLA requires the folder to
exist and never invalidates it: remove it after changing GPUs or
TensorFlow). docs/gpus.md has the measurements.

A flag the user's own XLA_FLAGS already sets is left as the user set it.
XLA reads XLA_FLAGS once, at its first compilation (not at TensorFlow's
import), in each process: `jobs.start_worker` applies this on every worker
before the model is built. The flags name GPU options; XLA's CPU compiler
ignores them (an unknown flag name would end the process).

TensorFlow-free.
"""

import dataclasses
import os
import shlex
from typing import Dict, Optional, Tuple

GEMM_BACKENDS = ("cublas", "triton")
TRITON_GEMM = "--xla_gpu_enable_triton_gemm"
AUTOTUNE_CACHE = "--xla_gpu_per_fusion_autotune_cache_dir"
CACHE_FOLDER = "xla_autotune"


@dataclasses.dataclass(frozen=True)
class XlaSetup:
    """What `compose` decided.

    Attributes:
        flags: The XLA_FLAGS value to run with.
        description: One line for the start banner.
    """

    flags: str
    description: str


def choose(requested: Optional[bool], on_gpus: bool) -> Tuple[bool, str]:
    """(XLA on, why: for the start banner) from `--xla` (`requested`: True,
    False, or None for auto) and whether the worker's devices are GPUs."""
    if requested is not None:
        return requested, "as asked"
    if on_gpus:
        return True, "auto: the worker's devices are GPUs"
    return False, "auto: off on CPUs, where it is slower; --xla forces it"


def _flag_names(flags: str) -> Dict[str, str]:
    """{--name: the whole flag} of an XLA_FLAGS value."""
    return {flag.split("=", 1)[0]: flag for flag in shlex.split(flags)}


def compose(user_flags: str, gemm: str, cache_dir: Optional[str]
            ) -> XlaSetup:
    """XLA_FLAGS for `gemm` ("cublas" or "triton") and an autotune cache
    in `cache_dir` (None: none), keeping every flag of `user_flags`.

    Raises:
        ValueError: `gemm` is not one of GEMM_BACKENDS.
    """
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"xla_gemm must be one of {GEMM_BACKENDS}, got "
                         f"{gemm!r}")
    users = _flag_names(user_flags)
    ours = {TRITON_GEMM: f"{TRITON_GEMM}={str(gemm == 'triton').lower()}"}
    if cache_dir:
        ours[AUTOTUNE_CACHE] = f"{AUTOTUNE_CACHE}={cache_dir}"
    added = [flag for name, flag in ours.items() if name not in users]
    if TRITON_GEMM in users:
        gemms = f"GEMMs as XLA_FLAGS says ({users[TRITON_GEMM]})"
    else:
        gemms = ("GEMMs on cuBLAS" if gemm == "cublas"
                 else "GEMMs on Triton (XLA's autotuning)")
    cache = users.get(AUTOTUNE_CACHE, ours.get(AUTOTUNE_CACHE))
    description = gemms + (f", autotune cache {cache.split('=', 1)[1]}"
                           if cache else "")
    return XlaSetup(" ".join([user_flags.strip(), *added]).strip(),
                    description)


def apply(gemm: str, output_dir: Optional[str],
          environ=os.environ) -> XlaSetup:
    """Composes XLA_FLAGS into `environ` (this process and the processes
    it starts), with the autotune cache under `output_dir` (created), and
    returns what was set. No cache for a remote `output_dir` (a URL:
    XLA's cache is a local folder)."""
    cache_dir = None
    if output_dir and "://" not in output_dir:
        cache_dir = os.path.abspath(os.path.join(output_dir, CACHE_FOLDER))
    user_flags = environ.get("XLA_FLAGS", "")
    setup = compose(user_flags, gemm, cache_dir)
    if cache_dir and AUTOTUNE_CACHE not in _flag_names(user_flags):
        os.makedirs(cache_dir, exist_ok=True)
    environ["XLA_FLAGS"] = setup.flags
    return setup
