r"""A wheelhouse for a host without internet: tfscale and every wheel it
needs, for the target's Python and platform, built where the internet is.

    # where the internet is (any OS), for an x86-64 Linux GPU host on 3.12:
    python -m launch.wheelhouse --output wheels --extras and-cuda,mpi \
        --python-version 3.12
    # carry wheels/ over; there, offline:
    cd wheels && sha256sum -c SHA256SUMS
    python3.12 -m venv tfscale && tfscale/bin/pip install --no-index \
        --find-links wheels "tfscale[and-cuda,mpi]"

    python -m launch.wheelhouse --list --extras and-cuda --python-version 3.12
                                   # names the wheels, downloads none

It builds tfscale's own wheel from this checkout, then `pip download`s its
requirements with the extras asked for (`tensorflow[and-cuda]` brings
CUDA, cuDNN and NCCL: `nvidia-nccl-cu12`), binary wheels only, for
`--python-version` and `--platform` (default: manylinux x86-64). Writes
`SHA256SUMS` (sha256sum's format) and `manifest.json` (what was asked, the
wheels, the install command). Exit 2 with one line when pip cannot find a
wheel for the target (its error's last line).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import List, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# pip's platform tags for an x86-64 Linux host (glibc 2.17 or newer):
# TensorFlow 2.21's wheels are manylinux_2_27, NVIDIA's manylinux2014 or
# manylinux_2_17, Open MPI's manylinux_2_28.
LINUX_X86_64 = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                "manylinux_2_5_x86_64", "manylinux1_x86_64")


def target_flags(python_version: str, platforms: Sequence[str]) -> List[str]:
    """pip's flags for wheels of another Python and platform."""
    flags = ["--only-binary=:all:", "--implementation", "cp",
             "--python-version", python_version]
    for platform in platforms:
        flags += ["--platform", platform]
    return flags


def requirement(wheel: str, extras: Sequence[str]) -> str:
    """tfscale's wheel with its extras, as pip takes it."""
    return wheel + (f"[{','.join(extras)}]" if extras else "")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(output: str, asked: dict) -> dict:
    """SHA256SUMS and manifest.json for the wheels in `output`."""
    wheels = sorted(n for n in os.listdir(output) if n.endswith(".whl"))
    sums = {name: sha256(os.path.join(output, name)) for name in wheels}
    with open(os.path.join(output, "SHA256SUMS"), "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in sums.items())
    extras = asked["extras"]
    manifest = dict(asked, wheels=sums, made=time.strftime("%Y-%m-%d"),
                    install=("pip install --no-index --find-links WHEELHOUSE "
                             + repr(requirement("tfscale", extras))))
    with open(os.path.join(output, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


class PipError(Exception):
    """A pip step that failed: the step in words, and pip's output."""

    def __init__(self, step: str, out: subprocess.CompletedProcess):
        super().__init__(step)
        self.step, self.out = step, out


def pip(args: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args],
                          capture_output=True, text=True)


def failed(step: str, out: subprocess.CompletedProcess) -> int:
    lines = [line for line in (out.stderr + out.stdout).splitlines()
             if line.strip() and not line.startswith("WARNING")]
    print(f"launch.wheelhouse: error: {step}: "
          f"{lines[-1] if lines else 'pip failed'}", file=sys.stderr)
    return 2


# What a copy of the checkout leaves out to build the wheel (setuptools
# writes build/ and *.egg-info beside the sources it builds).
NOT_SOURCES = (".git", ".venv", "build", "dist", "runs", "*.egg-info",
               "__pycache__", ".pytest_cache", ".gpu", "*.whl", "*.tfrecord")


def build_wheel(output: str) -> str:
    """tfscale's wheel from a copy of this checkout (which it leaves as it
    was), in `output`; its path."""
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        source = os.path.join(scratch, "tfscale")
        shutil.copytree(REPO, source,
                        ignore=shutil.ignore_patterns(*NOT_SOURCES))
        out = pip(["wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                   output, source])
    if out.returncode != 0:
        raise PipError("building tfscale's wheel", out)
    made = sorted(n for n in os.listdir(output)
                  if n.startswith("tfscale-") and n.endswith(".whl"))
    return os.path.join(output, made[-1])


def listed(wheel: str, extras, flags) -> List[str]:
    """The wheels pip would download for `wheel` with `extras`
    (`name==version`), from its dry run's report (no wheel downloaded
    where the index serves their metadata)."""
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "report.json")
        out = pip(["install", "--dry-run", "--ignore-installed", "-q",
                   "--target", os.path.join(scratch, "target"),
                   "--report", report, *flags, requirement(wheel, extras)])
        if out.returncode != 0:
            raise PipError("resolving", out)
        with open(report) as f:
            items = json.load(f)["install"]
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                  for i in items)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.wheelhouse",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="wheelhouse",
                        help="the wheelhouse folder (default: wheelhouse)")
    parser.add_argument("--extras", default="",
                        help="tfscale's extras, comma-separated (and-cuda: "
                             "TensorFlow's CUDA, cuDNN and NCCL wheels)")
    parser.add_argument("--python-version", "--python_version",
                        dest="python_version",
                        default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the target's Python, e.g. 3.12 (default: "
                             "this one's)")
    parser.add_argument("--platform", action="append", default=None,
                        help="a pip platform tag of the target, repeatable "
                             "(default: manylinux x86-64, glibc 2.17+)")
    parser.add_argument("--list", action="store_true",
                        help="name the wheels it would download, download "
                             "none")
    args = parser.parse_args(argv)
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    platforms = args.platform or list(LINUX_X86_64)
    flags = target_flags(args.python_version, platforms)
    os.makedirs(args.output, exist_ok=True)
    try:
        wheel = build_wheel(os.path.abspath(args.output))
        if args.list:
            print("\n".join(listed(wheel, extras, flags)))
            return 0
        out = pip(["download", "-q", "-d", args.output, *flags,
                   requirement(wheel, extras)])
        if out.returncode != 0:
            raise PipError(f"downloading for Python {args.python_version} "
                           f"({platforms[0]}, ...)", out)
    except PipError as e:
        return failed(e.step, e.out)
    manifest = write_manifest(args.output, {
        "python_version": args.python_version, "platforms": platforms,
        "extras": extras})
    print(f"{len(manifest['wheels'])} wheels in {args.output}; offline: "
          f"{manifest['install']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
