"""The step breakdown groups a traced step's time exactly and runs through the product on CPU."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.parametrize(("name", "group"), [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "fused_elementwise"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_view_3", "fused_elementwise"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "memory"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "eager_elementwise"),
])
def test_kernel_groups(name, group):
    assert load_benchmark("step_breakdown").kernel_group(name) == group


def test_split_counts_every_microsecond_once_and_adds_up_to_the_wall_time():
    bench = load_benchmark("step_breakdown")
    events = [
        {"name": "sm90_xmma_gemm_a", "ts": 0, "dur": 10},            # gemm 0-10
        {"name": "flash_fwd", "ts": 5, "dur": 10},                   # attention 5-15 (overlaps the GEMM)
        {"name": "triton_poi_fused_add_0", "ts": 20, "dur": 5},      # fused 20-25
        {"name": "triton_poi_fused_add_0", "ts": 22, "dur": 5},      # fused 22-27 (overlaps itself)
        {"name": "multi_tensor_apply_kernel", "ts": 30, "dur": 4},   # optimizer 30-34
    ]
    split = bench.split_trace(events, wall_us=40)
    # Attention comes first in the group order, so the overlap 5-10 is attention's.
    assert split["attention"] == 10 and split["gemm"] == 5
    assert split["fused_elementwise"] == 7 and split["optimizer"] == 4
    assert split["idle"] == 40 - 26
    assert sum(split[g] for g in (*bench.GROUPS, "idle")) == 40
    assert split["top_kernels"]["fused_elementwise"] == [["triton_poi_fused_add_0", 0.01]]
    assert split["fused_kinds"] == {"rope": 0.0, "norm": 0.0, "gelu": 0.0, "other": 10.0}  # kernel time, overlaps kept


@pytest.mark.parametrize(("name", "kind"), [
    ("triton_red_fused__to_copy_add_div_expand_mul_neg_pow_select_stack_sum_transpose_unsqueeze_view_15", "rope"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_stack_sub_unbind_unsqueeze_view_3", "rope"),
    ("triton_per_fused__to_copy_add_mul_native_layer_norm_backward_split_view_16", "norm"),
    ("triton_poi_fused_gelu_gelu_backward_view_5", "gelu"),
    ("triton_red_fused__to_copy_add_mul_split_sum_view_3", "other"),
])
def test_fused_kernels_are_split_by_the_ops_they_name(name, kind):
    assert load_benchmark("step_breakdown").fused_kind(name) == kind


def test_flop_split_adds_up_to_the_model_flops():
    from lightning_adaptiveload.models.wan import WAN_CONFIGS, wan_forward_flops

    config = WAN_CONFIGS["wan2_1_1_3b"]
    split = load_benchmark("step_breakdown").flop_split(config, 2, 7800)
    assert split["total"] == 3 * 2 * wan_forward_flops(config, 7800)
    assert split["attention"] + split["gemm"] == split["total"]
    assert split["attention"] == 3 * 2 * 30 * (4 * 7800**2 * 1536 + 4 * 7800 * 512 * 1536)


@pytest.mark.slow  # 15 s on a 2-core CPU under load: off the quick path
def test_runs_through_the_product_on_cpu(tmp_path):
    bench = load_benchmark("step_breakdown")
    out = tmp_path / "breakdown.json"
    assert bench.main(["--model", "tiny", "--shapes", "2x1x4x4,1x3x4x6", "--accelerator", "cpu",
                       "--setting", "eager_full", "--steps", "10", "--warmup", "2", "--profile-steps", "1",
                       "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    result = record["result"]
    assert set(result["shapes"]) | set(result["meta"]["not_traced"]) == {"2x16", "1x72"}
    assert result["shapes"], "no shape was traced"
    for key, entry in result["shapes"].items():
        assert entry["traced_steps"] == 1
        assert sum(entry["group_share"].values()) == pytest.approx(1.0, abs=1e-6)
        assert sum(entry["points"].values()) == pytest.approx(1.0, abs=1e-6)
        assert set(entry["fused_kinds_ms"]) == {"rope", "norm", "gelu", "other"}
        b, s = (int(v) for v in key.split("x"))
        assert entry["tokens_per_s"] == pytest.approx(b * s / (entry["step_ms"] / 1e3))


def test_ceilings_time_the_step_operations_and_count_their_flops():
    from lightning_adaptiveload.models.wan import WAN_CONFIGS

    config = WAN_CONFIGS["tiny"]
    ceil = load_benchmark("step_breakdown").ceilings([(2, (1, 4, 4))], config, dtype_name="float32", reps=2, device="cpu")["2x16"]
    for name, flops in (("self_attention", 3 * 4 * 2 * 16 * 16 * 64), ("cross_attention", 3 * 4 * 2 * 16 * 16 * 64),
                        ("qkvo", 3 * 2 * 32 * 64 * 64), ("ffn_up", 3 * 2 * 32 * 64 * 128)):
        assert ceil[name]["ms"] > 0
        assert ceil[name]["tflops"] == pytest.approx(flops / (ceil[name]["ms"] / 1e3) / 1e12)
    # The block's GEMMs: six D x D projections at M = B*S (self q, k, v, o; cross q, o) and the FFN.
    seconds = (6 * ceil["qkvo"]["ms"] + ceil["ffn_up"]["ms"] + ceil["ffn_down"]["ms"]) / 1e3
    flops = 3 * 2 * 32 * (6 * 64 * 64 + 2 * 64 * 128)
    assert ceil["block_gemms_tflops"] == pytest.approx(flops / seconds / 1e12)
