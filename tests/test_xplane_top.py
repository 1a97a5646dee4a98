"""benchmarks/gpu/xplane_top.py on a synthetic GPU profile: kernels summed by
their full names (two Eigen kernels whose names agree in their first 120
characters stay two rows), and op time grouped by (op type, dtype)."""

import pytest
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from benchmarks.gpu import xplane_top

EIGEN = ("void Eigen::internal::EigenMetaKernel<Eigen::TensorEvaluator<Eigen::"
         "TensorAssignOp<Eigen::TensorMap<Eigen::Tensor<")


def profile() -> xplane_pb2.XPlane:
    plane = xplane_pb2.XPlane(name="/device:GPU:0")
    kernels = {1: EIGEN + "Eigen::bfloat16, 1, 1, long>, 16>, ...mul...>",
               2: EIGEN + "float, 1, 1, long>, 16>, ...mul...>",
               3: "BiasGradNHWC_SharedAtomics<Eigen::bfloat16>"}
    for key, name in kernels.items():
        plane.event_metadata[key].id = key
        plane.event_metadata[key].name = name
    plane.stat_metadata[7].id = 7
    plane.stat_metadata[7].name = "tf_op"
    line = plane.lines.add()
    for key, op, ms in ((1, "layer_0/mul:Mul", 3.0), (2, "layer_0/mul_1:Mul", 2.0),
                        (1, "layer_1/mul:Mul", 1.0),
                        (3, "gradients/BiasAddGrad:BiasAddGrad", 4.0)):
        event = line.events.add(metadata_id=key, duration_ps=int(ms * 1e9))
        event.stats.add(metadata_id=7, str_value=op)
    return plane


def test_kernels_by_full_name_and_ops_by_type_and_dtype():
    assert len(EIGEN) > 100
    total, kernels, ops, typed = xplane_top.plane_times(profile())
    assert total == pytest.approx(10.0)
    assert len(kernels) == 3  # the two Eigen kernels apart
    assert sorted(kernels.values()) == pytest.approx([2.0, 4.0, 4.0])
    assert ops == pytest.approx({"Mul": 6.0, "BiasAddGrad": 4.0})
    assert typed == pytest.approx({("Mul", "bf16"): 4.0, ("Mul", "f32"): 2.0,
                                   ("BiasAddGrad", "bf16"): 4.0})


@pytest.mark.parametrize("name, dtype", [
    ("Mul_GPU_DT_FLOAT_DT_FLOAT_kernel", "f32"),
    ("Mul_GPU_DT_BFLOAT16_DT_BFLOAT16_kernel", "bf16"),
    ("void cub::DeviceReduceKernel<Eigen::half, float>", "f16"),
    ("ampere_bf16_s16816gemm_bf16_128x128", "bf16"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
     "bf16 (f32 acc)"),
    ("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x64x32", "tf32 (f32 "
     "acc)"),
    ("sm90_xmma_gemm_f16f16_f16f16_f16_nn_n_tilesize64x64x32", "f16"),
    (EIGEN + "unsigned short, 4, 1, long>, 16>, ...shuffling...>",
     "16-bit move"),
    ("loop_fusion_3", "?")])
def test_kernel_dtype_from_its_name(name, dtype):
    assert xplane_top.kernel_dtype(name) == dtype
