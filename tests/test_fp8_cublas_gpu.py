"""g01's FP8Linear with w8a8 on CUDA (skipped without CUDA): cuBLAS's block-scaled GEMM from 128 tokens, k05 below.

Whatever path a call takes, the output equals k05's w8a8_linear (the same sums: equal up to accumulation order), for
token counts cuBLAS takes (multiples of 4) and ones it refuses (padded), and for a 256 x 256 weight, whose result
cuBLAS got wrong on the H200 (torch 2.11, CUDA 13): the per-linear probe must catch that and keep k05's kernel.
"""

import pytest
import torch

from course.grader import select

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n, k", [(5120, 2048), (2048, 4096), (256, 256)])
def test_fp8_linear_w8a8_matches_k05(n, k):
    select.use({"default": "solutions"})
    g01, k05 = select.load("g01_gpu_engine"), select.load("k05_fp8")
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    linear = g01.FP8Linear([n], k, act_fp8=True, device="cuda")
    q, s = k05.quantize_block_fp8(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    linear.weight.copy_(q)
    linear.weight_scale_inv.copy_(s)
    for t in (1, 64, 128, 131, 256, 1001):
        x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
        ref = k05.w8a8_linear(x, q, s).float()
        y = linear(x).float()
        err = (y - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, f"N={n} K={k} T={t}: FP8Linear differs from k05's w8a8_linear by {err:.3g} (relative)"
    assert linear.cublas_refused != "unprobed", "a 128-token call never probed cuBLAS"
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if (n, k) != (256, 256) and torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9):
        assert linear.cublas_refused is None, f"cuBLAS not used for N={n} K={k}: {linear.cublas_refused}"
