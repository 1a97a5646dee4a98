"""--xla's XLA_FLAGS (tfscale/xla_flags.py): GEMMs on cuBLAS by default, an
autotune cache under the output folder, the user's own flags kept; and on
the real path, the flags XLA ran with in a worker (its dumped
`debug_options`)."""

import shlex
import sys

import pytest

from tests.conftest import run_command
from tests.test_pretraining import pretrain_args
from tfscale import xla_flags


def test_cublas_by_default_with_a_cache():
    setup = xla_flags.compose("", "cublas", "/runs/x/xla_autotune")
    assert setup.flags == ("--xla_gpu_enable_triton_gemm=false "
                           "--xla_gpu_per_fusion_autotune_cache_dir="
                           "/runs/x/xla_autotune")
    assert setup.description == ("GEMMs on cuBLAS, autotune cache "
                                 "/runs/x/xla_autotune")


def test_triton_is_xlas_own_choice():
    setup = xla_flags.compose("", "triton", None)
    assert setup.flags == "--xla_gpu_enable_triton_gemm=true"
    assert setup.description == "GEMMs on Triton (XLA's autotuning)"


def test_the_users_flags_win_and_stay():
    user = ("--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=true "
            "--xla_gpu_per_fusion_autotune_cache_dir=/mine")
    setup = xla_flags.compose(user, "cublas", "/runs/x/xla_autotune")
    assert setup.flags == user
    assert setup.description == ("GEMMs as XLA_FLAGS says "
                                 "(--xla_gpu_enable_triton_gemm=true), "
                                 "autotune cache /mine")
    # Only the flag the user set is theirs; the other is added.
    setup = xla_flags.compose("--xla_gpu_enable_triton_gemm=true", "cublas",
                              "/c")
    assert setup.flags == ("--xla_gpu_enable_triton_gemm=true "
                           "--xla_gpu_per_fusion_autotune_cache_dir=/c")


def test_apply_sets_the_environment_and_makes_the_cache(tmp_path):
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    setup = xla_flags.apply("cublas", str(tmp_path / "run"), environ)
    cache = tmp_path / "run" / "xla_autotune"
    assert environ["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=false "
        f"--xla_gpu_per_fusion_autotune_cache_dir={cache}")
    assert cache.is_dir() and setup.flags == environ["XLA_FLAGS"]
    remote = {}
    xla_flags.apply("cublas", "gs://bucket/run", remote)
    assert remote["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
    with pytest.raises(ValueError, match="xla_gemm"):
        xla_flags.compose("", "cudnn", None)


@pytest.mark.slow
def test_every_worker_compiles_with_the_composed_flags(corpus, tmp_path):  # noqa: F811
    """2 workers through launch.local with --xla, each dumping XLA's record
    of the options it compiled with (`debug_options`, under the user's
    --xla_dump_to, one folder per worker). Worker 0 is given the user's
    --xla_gpu_enable_triton_gemm=true, worker 1 nothing: the user's flag
    wins on worker 0 and the chief's banner says which, worker 1 compiles
    with the cuBLAS choice; both with the cache folder. (One run for both
    cases, the suite's budget; the default's banner text is the unit test
    above. The dump lists the options that differ from XLA's defaults:
    Triton GEMMs on is the default.)"""
    cublas = "xla_gpu_enable_triton_gemm: false"
    out, dump = tmp_path / "run", tmp_path / "dump"
    worker = " ".join(shlex.quote(a) for a in [
        sys.executable, "run_pretraining.py",
        *pretrain_args(corpus, out, 2, "--xla", "--num_warmup_steps=1")])
    user = ('$([ "$TFSCALE_WORKER_INDEX" = 0 ] && '
            'echo --xla_gpu_enable_triton_gemm=true)')
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2",
         "--threads_per_worker", "1", "--", "sh", "-c",
         f'XLA_FLAGS="--xla_dump_to={dump}/$TFSCALE_WORKER_INDEX '
         f'{user}" exec {worker}'], timeout=400)
    assert code == 0, output[-5000:]
    assert ("XLA on a GPU: GEMMs as XLA_FLAGS says "
            "(--xla_gpu_enable_triton_gemm=true)") in output, output[-3000:]
    cache = out / "xla_autotune"
    assert cache.is_dir()
    for index, triton in (("0", True), ("1", False)):
        options = list((dump / index).glob("*.debug_options"))
        assert options, f"worker {index} dumped no debug_options"
        for path in options:
            text = path.read_text()
            assert (cublas not in text) == triton, (path, text)
            assert (f'xla_gpu_per_fusion_autotune_cache_dir: "{cache}"'
                    in text), path


@pytest.mark.parametrize("requested, on_gpus, expected", [
    (None, True, (True, "auto: the worker's devices are GPUs")),
    (None, False, (False, "auto: off on CPUs, where it is slower; --xla "
                          "forces it")),
    (True, False, (True, "as asked")), (False, True, (False, "as asked"))])
def test_xla_is_on_by_default_on_gpus_only(requested, on_gpus, expected):
    assert xla_flags.choose(requested, on_gpus) == expected


def test_the_xla_flag_takes_auto_true_and_false():
    """`--xla` is auto (None) unless given; `--xla`, `--noxla` and
    `--xla=auto` as a user types them."""
    from absl import flags
    from models.tasks.flags import define_auto_bool
    for argv, value in (([], None), (["--xla"], True), (["--noxla"], False),
                        (["--xla=auto"], None), (["--xla=false"], False)):
        values = flags.FlagValues()
        define_auto_bool(flags, "xla", "auto", "XLA", flag_values=values)
        values(["prog", *argv])
        assert values.xla is value, argv


def test_the_trainers_auto_xla_follows_the_strategys_devices():
    """`TrainConfig(jit_compile=None)` and the default `compile_update`
    (None): on where the strategy's devices are GPUs (tf.distribute's GPU
    layout on this CPU), off on CPUs; a forced value stays."""
    import tensorflow as tf
    from tfscale.train_config import TrainConfig, resolve_auto
    auto = TrainConfig(global_batch_size=8, jit_compile=None)
    assert auto.compile_update is None
    for device, on in (("/gpu:0", True), ("/cpu:0", False)):
        strategy = tf.distribute.MirroredStrategy([device])
        resolved = resolve_auto(auto, strategy)
        assert resolved.jit_compile is on
        assert resolved.compile_update is on
    forced = TrainConfig(global_batch_size=8, jit_compile=True,
                         compile_update=True)
    assert resolve_auto(forced, strategy) is forced
    half = resolve_auto(TrainConfig(global_batch_size=8, jit_compile=True),
                        strategy)
    assert half.jit_compile is True and half.compile_update is False
