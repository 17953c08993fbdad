"""G01 · The GPU engine: the model, KV cache and GDN state pool on the device, Triton backends, CUDA graphs.

The CPU engine of Track E stays as it is; on CUDA the same LLM runs a different *backend*:

    weights          built directly on the device in bf16 (fp32 / fp16 too), loaded or dummy-initialised there
    KV cache         [num_blocks, P, nKV, D] per attention layer, num_blocks sized from free memory
                     (gpu_memory_utilization, as vLLM / nano-vllm) unless num_kvcache_blocks is given
    layers           norms -> k01 add_rms_norm, attention -> k02 TritonPagedAttention (store + prefill / split-K
                     decode), MoE -> k03 fused_moe_forward, Gated DeltaNet -> k04 gdn_prefill / gdn_decode working
                     in place on the state pool through each sequence's slot index
    one step         the batch's int metadata staged in ONE pinned host buffer and copied with ONE H2D copy;
                     no host sync inside the forward; sampling on the device; one D2H copy of the tokens
    decode           CUDA graphs captured at start for batch-size buckets 1, 2, 4, 8, 16, 32, ... max_num_seqs:
                     replay = copy this step's inputs into the graph's static buffers + graph.replay().
                     A batch of b runs the smallest bucket >= b; the padded rows have slot -1 (their K/V and
                     GDN state are written nowhere) and context length 0.
    prefill / mixed  eager (their shapes change every step; the kernels are large, launch cost is small)

A graph records the *addresses* of its inputs: every step must write into the same static tensors (a
fresh tensor would be silently ignored: the graph keeps reading the stale buffer), and nothing inside
the captured region may synchronise with the host (.item(), .tolist(), a data-dependent shape).

Lesson: lessons/g01_gpu_engine.md (书 §G.1).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import nn

from course.runtime import memory
from course.runtime.memory import MemoryPlan

from .e01_sampling import Sampler, SamplingParams, make_generator
from .e02_block_manager import BlockManager, Sequence, SequenceStatus, compute_block_hash
from .e03_scheduler import Scheduler, SchedulerConfig
from .e04_model_runner import GDNStatePool, ModelRunner
from .e05_engine import LLM as CPULLM
from .e05_engine import EngineConfig, _load
from .e07_hybrid_prefix_cache import HybridBlockManager, HybridScheduler, SnapshotRunner, StateCache
from .k01_triton_basics import add_rms_norm
from .k02_paged_attention import TritonPagedAttention
from .k03_fused_moe import fused_moe_forward
from .k04_gdn_kernels import CHUNK, gdn_decode, gdn_prefill
from .k05_fp8 import BLOCK as FP8_BLOCK
from .k05_fp8 import fp8_linear, fused_experts_fp8, quantize_act_fp8, quantize_block_fp8, w8a8_linear
from .m01_rmsnorm import GemmaRMSNorm, RMSNorm
from .m03_sparse_moe import MoEWeights, SharedExpert, route
from .m04_attention import AttentionContext, GatedAttention
from .m05_gated_deltanet import GatedDeltaNet
from .m06_models import (MLP, CausalLM, CheckpointError, SparseMoeBlock, build_model, dequantize_block_fp8,
                         fp8_block_size, load_checkpoint, map_checkpoint_key, shard_view, text_config)


# ----------------------------------------------------------------------------- the kernel backends
class KernelNorm(nn.Module):
    """m01's RMSNorm / GemmaRMSNorm protocol through k01's fused add + RMSNorm kernel (same weight)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps, self.gemma = norm.weight, norm.eps, isinstance(norm, GemmaRMSNorm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return add_rms_norm(x, residual, self.weight, self.eps, gemma=self.gemma)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])   # positions: a view at offset N of the staged buffer
def _qk_norm_rope_kernel(qkv_ptr, out_ptr, qw_ptr, kw_ptr, pos_ptr, cache_ptr, stride_t, stride_qh, k_col, stride_ot,
                         stride_cache, eps, D, HALF_R, NQ, NH, GEMMA: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Token t, heads hb*BLOCK_H ..: RMSNorm over D (m01's cast order), then rotate-half RoPE on the first 2*HALF_R dims.

    Heads 0 .. NQ-1 are q (column h * stride_qh of the qkv row, weight qw), heads NQ .. NH-1 are k (column
    k_col + (h - NQ) * D, weight kw): q and k of a token in one program, one launch per layer."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]            # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]                                        # [1, BLOCK_D]
    is_q = h < NQ
    mask = (h < NH) & (d < D)
    row = qkv_ptr + t * stride_t + tl.where(is_q, h * stride_qh, k_col + (h - NQ) * D)
    w_row = tl.where(is_q, qw_ptr, kw_ptr)
    x = tl.load(row + d, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]               # [BLOCK_H, 1] fp32
    w = tl.load(w_row + d, mask=mask, other=0.0).to(tl.float32)
    # rotate-half: pair (i, i + R/2) turned by angle i; the partner's normalised value comes from its own load
    rotary = mask & (d < 2 * HALF_R)
    partner = tl.where(d < HALF_R, d + HALF_R, d - HALF_R)
    xp = tl.load(row + partner, mask=rotary, other=0.0).to(tl.float32)
    wp = tl.load(w_row + partner, mask=rotary, other=0.0).to(tl.float32)
    if GEMMA:                                        # (1 + w) in fp32, then cast
        y = (xf * inv * (1.0 + w)).to(x.dtype).to(tl.float32)
        yp = (xp * inv * (1.0 + wp)).to(x.dtype).to(tl.float32)
    else:                                            # cast first, then * w (in the model dtype)
        y = (w * (xf * inv).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        yp = (wp * (xp * inv).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.where(d < HALF_R, d, d - HALF_R)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=d < 2 * HALF_R, other=1.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF_R + i, mask=d < 2 * HALF_R, other=0.0)
    rot = tl.where(d < HALF_R, y * cos - yp * sin, y * cos + yp * sin)
    out = tl.where(d < 2 * HALF_R, rot, y)
    tl.store(out_ptr + t * stride_ot + h * D + d, out.to(out_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 gemma: bool, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, nH, D], k [N, nKV, D] (strided views of ONE qkv projection output, k to the right of q in each row)
    -> RoPE(RMSNorm(q)), RoPE(RMSNorm(k)) as views of one [N, nH + nKV, D] tensor, in one launch."""
    num_tokens, nq, dim = q.shape
    nh = nq + k.shape[1]
    # (one token: torch may give the size-1 token dim of a view any stride, so only the layout within a row counts)
    assert (num_tokens == 1 or q.stride(0) == k.stride(0)) and q.stride(-1) == k.stride(-1) == 1 and k.stride(1) == dim
    out = torch.empty(num_tokens, nh, dim, dtype=q.dtype, device=q.device)
    if num_tokens:
        block_d = triton.next_power_of_2(dim)
        block_h = min(triton.next_power_of_2(nh), max(1, 4096 // block_d))    # <= 4096 elements a program
        _qk_norm_rope_kernel[(num_tokens, triton.cdiv(nh, block_h))](
            q, out, q_weight, k_weight, positions, cos_sin_cache, q.stride(0), q.stride(1),
            k.data_ptr() // k.element_size() - q.data_ptr() // q.element_size(), out.stride(0),
            cos_sin_cache.stride(0), eps, dim, rotary_dim // 2, nq, nh, GEMMA=gemma, BLOCK_H=block_h,
            BLOCK_D=block_d, num_warps=4)
    return out[:, :nq], out[:, nq:]


@dataclass
class MixedContext(AttentionContext):
    """A step whose first num_decodes sequences decode one token each and the rest prefill. Its own fields describe
    the whole batch as one prefill (what any other reader of the context sees); `decode` and `prefill` describe the
    two parts, so that attention runs the decode kernel on the decode rows: the prefill kernel handles a one-token
    query with a long context far slower (measured on an H200, Qwen3.5-35B-A3B, 254 decodes + one 110-token prefill:
    36 ms in the prefill kernel against 1.1 ms in the decode kernel for 256 decodes)."""
    decode: AttentionContext | None = None
    prefill: AttentionContext | None = None
    num_decodes: int = 0


class KernelAttention(nn.Module):
    """m04's Qwen3Attention / GatedAttention with q/k norm and RoPE fused into one launch for q and k together.

    m02 + m01 in torch take ~20 small kernels per layer for this; a decode step of a 28-layer model spends
    more time launching them than computing. 3-D (multimodal) positions fall back to the torch path.
    """

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.inner = attn
        self.gated = isinstance(attn, GatedAttention)
        self.gemma = isinstance(attn.q_norm, GemmaRMSNorm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        a = self.inner
        if positions.dim() != 1:
            return a(positions, hidden_states, ctx)
        nH, nKV, D = a.num_heads, a.num_kv_heads, a.head_dim
        q_width = 2 * a.q_size if self.gated else a.q_size
        q, k, v = a.qkv_proj(hidden_states).split([q_width, a.kv_size, a.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(-1, nH, 2 * D).chunk(2, dim=-1)                # per head [q_h | gate_h]
        else:
            q = q.view(-1, nH, D)
        rope = a.rotary
        q, k = qk_norm_rope(q, k.view(-1, nKV, D), a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, self.gemma,
                            positions, rope.cos_sin_cache, rope.rotary_dim)
        v = v.view(-1, nKV, D)
        if isinstance(ctx, MixedContext):        # decode rows through the decode kernel, the rest through prefill
            d = ctx.num_decodes
            o = torch.cat([a.attn(q[:d], k[:d], v[:d], ctx.decode), a.attn(q[d:], k[d:], v[d:], ctx.prefill)])
        else:
            o = a.attn(q, k, v, ctx)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return a.o_proj(o.flatten(1))


@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_kernel(x_ptr, out_ptr, num_rows, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    """Row r, columns c*BLOCK ..: out = silu(gate) * up for x = [gate | up], torch's roundings (each op to x.dtype)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + r * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)                   # F.silu, rounded like torch
    tl.store(out_ptr + r * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


class KernelMLP(nn.Module):
    """m06's dense MLP with SiLU(gate) * up in one launch (torch runs silu and * as two kernels and writes the
    [N, I] silu output in between: at a 16k-token prefill step that is 3 x 100 MB of extra traffic per layer)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp
        for hook in mlp._forward_hooks.values():      # m07's all-reduce of the partial sums under tensor parallel
            self.register_forward_hook(hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.mlp.gate_up_proj(x)                                    # [N, 2I]
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        h = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(inter, 1024))](gate_up, h, rows, inter, gate_up.stride(0),
                                                              h.stride(0), BLOCK=1024, num_warps=4)
        return self.mlp.down_proj(h)


def use_fused_mlp(model: CausalLM) -> None:
    """Every dense MLP -> KernelMLP (a speed-up the exercise gives: MoE layers have k03's fused SiLU already)."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, MLP):
            layer.mlp = KernelMLP(layer.mlp)


class KernelMoE(nn.Module):
    """m06's SparseMoeBlock through k03's fused MoE: m03's router, one grouped GEMM per projection.

    Outside the decode graphs (prefill and mixed steps run eager) this layer replays a CUDA graph of itself when
    GPUModelRunner.capture_moe_graphs has captured one for the step's token count rounded up to a bucket: eager,
    one MoE layer is ~20 launches (router, k03's align and grouped GEMMs, the shared expert), each with its Python
    dispatch cost, for ~0.4 ms of GPU work at a few hundred tokens (a profiled Qwen3.5-35B-A3B step of 64 decodes and
    230 prefill tokens: 15 ms of grouped GEMMs over 40 layers, 26 ms of kernels in all against 70 ms of launching)."""

    def __init__(self, block: SparseMoeBlock):
        super().__init__()
        self.block = block
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}     # token bucket -> this layer captured at that many rows
        self.buckets: list[int] = []                          # sorted keys of graphs
        self.io: tuple[torch.Tensor, torch.Tensor] | None = None   # static [max bucket, H] input and output
        for hook in block._forward_hooks.values():    # m07's all-reduce of the partial sums under tensor parallel
            self.register_forward_hook(hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.buckets and 0 < n <= self.buckets[-1] and not torch.cuda.is_current_stream_capturing():
            bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
            static_in, static_out = self.io
            static_in[:n].copy_(x)
            static_in[n:bucket].zero_()                       # padding rows: zeros, whose outputs nobody reads
            self.graphs[bucket].replay()
            return static_out[:n]     # shared by every layer: read (the next layer's add + norm) before the next replay
        return self.eager(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        if b.experts.gate_up_proj.dtype == FP8:
            return self.eager_fp8(x)
        gate_up, inter = b.experts.gate_up_proj, b.experts.down_proj.shape[-1]
        shared = None
        if b.shared_expert is not None:
            s_gate, s_up = b.shared_expert.gate_up_proj.weight.chunk(2, dim=0)
            shared = SharedExpert(gate_proj=s_gate, up_proj=s_up, down_proj=b.shared_expert.down_proj.weight,
                                  gate=b.shared_expert_gate.weight)
        w = MoEWeights(router=b.gate.weight, w_gate=gate_up[:, :inter], w_up=gate_up[:, inter:],
                       w_down=b.experts.down_proj, top_k=b.top_k, norm_topk_prob=b.norm_topk_prob, shared=shared)
        return fused_moe_forward(x, w)

    def eager_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """FP8 experts (use_fp8): m03's router, k05's fused_experts_fp8 on views of the fused tensors and of their
        stacked scale grids (gate's, then up's), the shared expert through its own (FP8) linears."""
        b, e = self.block, self.block.experts
        inter, grid = e.down_proj.shape[-1], e.gate_up_proj_scale_inv.shape[1] // 2
        weights, ids = route(x, b.gate.weight, b.top_k, b.norm_topk_prob)
        out = fused_experts_fp8(x, e.gate_up_proj[:, :inter], e.gate_up_proj[:, inter:], e.down_proj,
                                e.gate_up_proj_scale_inv[:, :grid], e.gate_up_proj_scale_inv[:, grid:],
                                e.down_proj_scale_inv, weights, ids, act_fp8=getattr(e, "act_fp8", False))
        if b.shared_expert is not None:
            out = out + torch.sigmoid(x @ b.shared_expert_gate.weight.T) * b.shared_expert(x)
        return out


def moe_buckets(max_tokens: int) -> list[int]:
    """Token counts with a captured MoE graph: every 16 up to 256, then steps of 1/8 to 1/4 up to 2048 (past that a
    step's GPU work outlasts its host work, and eager costs nothing). Padding wastes at most ~25 % of one layer."""
    sizes = list(range(16, 257, 16)) + [320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    return [b for b in sizes if b <= max(16, min(max_tokens, 2048))]


@dataclass
class PoolState:
    """What a Gated DeltaNet layer gets instead of gathered copies: the pool itself and the batch's slots."""
    conv: torch.Tensor      # [S, C, K-1]      the layer's conv states, every slot
    ssm: torch.Tensor       # [S, nv, dk, dv]  fp32 recurrent states, every slot
    slots: torch.Tensor     # [B] int32        slot of each sequence of the batch, -1 = padding
    decode: bool            # one token per sequence
    num_decodes: int = 0    # a mixed step: sequences [0, num_decodes) decode one token, the rest prefill
    prefill_cu: torch.Tensor | None = None   # [P+1] int32 cu_seqlens of the prefilling rest, from 0
    prefill_slots: torch.Tensor | None = None   # [P] int32 slots of the prefilling rest (a copy: see _mixed)
    chunks: tuple[torch.Tensor, torch.Tensor] | None = None   # k04's chunk table of the prefill rows, built on the host


@triton.jit(do_not_specialize=["num_rows"])
def _norm_gated_kernel(x_ptr, z_ptr, w_ptr, out_ptr, num_rows, D, stride_x, stride_z, stride_o, eps,
                       ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """m01's rms_norm_gated on ROWS rows of D: w * norm(x) * silu(z), with its roundings (norm in fp32, cast to x's
    dtype, times w in that dtype; silu(z) in fp32; the product cast back)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 1) / D + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    n = (w[None, :].to(tl.float32) * h.to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (n * z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty),
             mask=mask)


def norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [R, D] (rows contiguous in D) -> [R, D] in x.dtype: one launch instead of torch's ~10 small kernels."""
    R, D = x.shape
    out = torch.empty_like(x)
    rows = 16
    _norm_gated_kernel[(triton.cdiv(R, rows),)](x, z, weight, out, R, D, x.stride(0), z.stride(0), out.stride(0), eps,
                                               ROWS=rows, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out


class KernelGDN(nn.Module):
    """m05's GatedDeltaNet with the token mixing done by k04, in place on the state pool."""

    def __init__(self, gdn: GatedDeltaNet):
        super().__init__()
        self.gdn = gdn

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, state: PoolState) -> torch.Tensor:
        g = self.gdn
        mixed = g.in_proj_qkv(hidden_states)                                  # [N, C]
        z = g.in_proj_z(hidden_states)                                        # [N, nv*dv]
        a, b = g.in_proj_a(hidden_states), g.in_proj_b(hidden_states)         # [N, nv]
        args = (mixed, a, b, g.conv1d.weight[:, 0], g.A_log, g.dt_bias)
        dims = (g.num_k_heads, g.head_k_dim, g.head_v_dim)
        if state.decode:
            o = gdn_decode(*args, state.conv, state.ssm, state.slots, *dims)
        elif state.num_decodes:          # mixed: the decode rows through gdn_decode (one chunk per token is slow)
            d, rest = state.num_decodes, args[3:]
            o = torch.cat([gdn_decode(mixed[:d], a[:d], b[:d], *rest, state.conv, state.ssm, state.slots[:d], *dims),
                           gdn_prefill(mixed[d:], a[d:], b[d:], *rest, state.prefill_cu, state.conv, state.ssm,
                                       state.prefill_slots, *dims, chunks=state.chunks)])
        else:
            o = gdn_prefill(*args, cu_seqlens, state.conv, state.ssm, state.slots, *dims, chunks=state.chunks)
        o = norm_gated(o.reshape(-1, g.head_v_dim), z.reshape(-1, g.head_v_dim), g.norm.weight, g.norm.eps)
        return g.out_proj(o.reshape(hidden_states.shape[0], g.value_dim))


def use_kernels(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_splits: int) -> None:
    """Swap every layer's torch path for its Triton backend, in place (parameters are shared, not copied)."""
    layers = iter(kv_caches)
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, KernelNorm(getattr(layer, name)))
        if layer.is_linear:
            layer.linear_attn = KernelGDN(layer.linear_attn)
        else:
            attn = layer.self_attn
            k_cache, v_cache = next(layers)
            b = attn.attn
            attn.attn = TritonPagedAttention(b.num_heads, b.head_dim, b.scale, b.num_kv_heads, k_cache, v_cache,
                                             num_splits=num_splits)
            layer.self_attn = KernelAttention(attn)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = KernelMoE(layer.mlp)
    model.model.norm = KernelNorm(model.model.norm)


# ----------------------------------------------------------------------------- block-FP8 weights (k05)
FP8 = torch.float8_e4m3fn
PACKED_SHARD = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}         # m06's shard of a packed linear -> its index here
FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
               "out_proj")                                 # what a Qwen FP8 checkpoint quantizes (not lm_head, router)


CUBLAS_FP8_MIN_TOKENS = 128   # set by hand, not read off k05.json (there cuBLAS leads from T = 64 on all four linears; §K.5)
CUBLAS_FP8_ROWS = 4           # cuBLAS's block-scaled GEMM takes token counts in multiples of this


def cublas_w8a8(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W8A8 through cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm with 1x128 activation groups and 128x128 weight
    blocks): k05's quantize_act_fp8, then y = (x_fp8 * x_scale) @ (w_fp8 * scale_inv)^T with fp32 accumulation, the
    same sums as k05's w8a8_linear. cuBLAS reads x_scale column-major and scale_inv as its transpose, and refuses a
    token count that is not a multiple of 4 (CUBLAS_STATUS_NOT_SUPPORTED on torch 2.11 + CUDA 13, H200: 4, 8, 12, 20
    ran, 1, 2, 15, 17, 4097 did not): x is padded with zero rows, whose outputs are dropped."""
    t = x.shape[0]
    if t % CUBLAS_FP8_ROWS:
        padded = x.new_zeros(t + CUBLAS_FP8_ROWS - t % CUBLAS_FP8_ROWS, x.shape[1])
        padded[:t] = x
        return cublas_w8a8(padded, w_fp8, scale_inv)[:t]
    x_fp8, x_scale = quantize_act_fp8(x)
    if x_scale.stride(0) != 1:
        x_scale = x_scale.t().contiguous().t()
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=scale_inv.t(), out_dtype=x.dtype)


def cublas_block_fp8_works(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> str | None:
    """None when cuBLAS runs the block-scaled FP8 GEMM for this linear and agrees with k05's w8a8_linear on x (the
    same fp32 sums: equal up to accumulation order); else why not (a build without it raises, e.g. before CUDA 12.9)."""
    try:
        ref = w8a8_linear(x, w_fp8, scale_inv).float()
        err = (cublas_w8a8(x, w_fp8, scale_inv).float() - ref).abs().max().item()
    except Exception as e:   # noqa: BLE001 - any failure means: use k05's kernel
        return f"{type(e).__name__}: {e}"[:200]
    bound = 1e-2 * ref.abs().max().item()
    return None if err <= bound else f"max |cuBLAS - k05| = {err:.3g} > {bound:.3g}"


class FP8Linear(nn.Module):
    """A bias-free linear with a block-FP8 weight, run by k05: weight [N, K] float8_e4m3fn and weight_scale_inv
    [G, ceil(K/128)] fp32. A packed linear (qkv_proj: q, k, v; gate_up_proj: gate, up) keeps each shard's own
    128-row scale grid, stacked (G = sum of ceil(rows/128)): the checkpoint's grids copied as they are. When every
    shard but the last has a multiple of 128 rows (real checkpoints) the stacked grids are the grid of the whole
    weight and one launch computes it; otherwise (tiny test models) one launch per shard."""

    def __init__(self, shard_rows: list[int], in_features: int, act_fp8: bool = False, device=None):
        super().__init__()
        self.shard_rows, self.in_features, self.act_fp8 = list(shard_rows), in_features, act_fp8
        self.out_features = sum(shard_rows)
        self.grid_rows = [triton.cdiv(n, FP8_BLOCK) for n in shard_rows]
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(sum(self.grid_rows), triton.cdiv(in_features, FP8_BLOCK),
                                                        dtype=torch.float32, device=device), requires_grad=False)
        self.one_launch = all(n % FP8_BLOCK == 0 for n in shard_rows[:-1])
        self.cublas_refused: str | None = "unprobed"     # None: cuBLAS runs w8a8 from CUBLAS_FP8_MIN_TOKENS on

    def cublas_ok(self, x: torch.Tensor) -> bool:
        """cuBLAS's block-scaled FP8 GEMM applies: one launch, N and K whole 128-blocks, and the first eager call
        found that cuBLAS runs it and agrees with k05 (never probed inside a CUDA graph capture)."""
        if not (x.is_cuda and self.one_launch and self.out_features % FP8_BLOCK == 0
                and self.in_features % FP8_BLOCK == 0):
            return False
        if self.cublas_refused == "unprobed":
            if torch.cuda.is_current_stream_capturing():
                return False
            self.cublas_refused = cublas_block_fp8_works(x, self.weight, self.weight_scale_inv)
        return self.cublas_refused is None

    def shard(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard i's weight rows and scale rows (views)."""
        row, grid = sum(self.shard_rows[:i]), sum(self.grid_rows[:i])
        return (self.weight[row:row + self.shard_rows[i]],
                self.weight_scale_inv[grid:grid + self.grid_rows[i]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = w8a8_linear if self.act_fp8 else fp8_linear
        x2 = x.reshape(-1, self.in_features)
        if self.act_fp8 and x2.shape[0] >= CUBLAS_FP8_MIN_TOKENS and self.cublas_ok(x2):
            try:
                return cublas_w8a8(x2, self.weight, self.weight_scale_inv).view(*x.shape[:-1], self.out_features)
            except RuntimeError as e:                    # a shape cuBLAS refuses: k05's kernel from now on
                if torch.cuda.is_current_stream_capturing():
                    raise
                self.cublas_refused = f"T={x2.shape[0]}: {e}"[:200]
        if self.one_launch:
            y = linear(x2, self.weight, self.weight_scale_inv)
        else:
            y = torch.cat([linear(x2, *self.shard(i)) for i in range(len(self.shard_rows))], dim=-1)
        return y.view(*x.shape[:-1], self.out_features)


def fp8_shard_rows(model: CausalLM, name: str, linear: nn.Linear) -> list[int] | None:
    """The shard rows of linear `name` if an FP8 checkpoint quantizes it (None: it stays in the model dtype)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in FP8_LINEARS:
        return None
    rows = linear.weight.shape[0]
    if leaf == "qkv_proj":
        kv = model.get_submodule(name.rsplit(".", 1)[0]).kv_size
        return [rows - 2 * kv, kv, kv]
    if leaf == "gate_up_proj":
        return [rows // 2, rows // 2]
    return [rows]


@torch.no_grad()
def use_fp8(model: CausalLM, act_fp8: bool = False, only: set[str] | None = None, quantize: bool = False) -> set[str]:
    """Block-FP8 weights in place: every linear an FP8 checkpoint quantizes -> FP8Linear, every MoE block's experts ->
    float8 gate_up_proj / down_proj plus gate_up_proj_scale_inv [E, 2 ceil(I/128), ceil(H/128)] (gate's grid, then
    up's) and down_proj_scale_inv [E, ceil(H/128), ceil(I/128)]. `only`: the module names to convert (those a
    checkpoint ships with scales); quantize: quantize the current weights (dummy weights) with k05's
    quantize_block_fp8 on their device, shard by shard. On the meta device (build_on_device) nothing is allocated.
    Returns the names of the converted modules."""
    done = set()
    for name, module in list(model.named_modules()):
        if only is not None and name not in only:
            continue
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear) and (rows := fp8_shard_rows(model, name, module)) is not None:
            fp8 = FP8Linear(rows, module.in_features, act_fp8, device=module.weight.device)
            if quantize:
                _quantize_into(fp8, "weight", module.weight)
            setattr(model.get_submodule(parent), leaf, fp8)
            done.add(name)
        elif leaf == "experts" and isinstance(model.get_submodule(parent), SparseMoeBlock):
            for pname in ("gate_up_proj", "down_proj"):
                full = getattr(module, pname)
                shards = 2 if pname == "gate_up_proj" else 1
                grid = (full.shape[0], shards * triton.cdiv(full.shape[1] // shards, FP8_BLOCK),
                        triton.cdiv(full.shape[2], FP8_BLOCK))
                setattr(module, pname, nn.Parameter(torch.empty(full.shape, dtype=FP8, device=full.device),
                                                    requires_grad=False))
                setattr(module, pname + "_scale_inv", nn.Parameter(
                    torch.ones(grid, dtype=torch.float32, device=full.device), requires_grad=False))
                if quantize:
                    _quantize_into(module, pname, full)
            module.act_fp8 = act_fp8
            done.add(name)
    return done


def _quantize_into(module: nn.Module, pname: str, values: torch.Tensor) -> None:
    """k05's quantize_block_fp8 of `values` (the model-dtype weight) into FP8 parameter `pname` of `module` and its
    scales, shard by shard: an FP8Linear's q / k / v or gate / up rows, an experts tensor's gate and up halves."""
    if isinstance(module, FP8Linear):
        parts = [(values_part, *module.shard(i)) for i, values_part in enumerate(values.split(module.shard_rows))]
    else:
        weight, scale = getattr(module, pname), getattr(module, pname + "_scale_inv")
        n = 2 if pname == "gate_up_proj" else 1
        parts = list(zip(values.chunk(n, dim=1), weight.chunk(n, dim=1), scale.chunk(n, dim=1)))
    for part, w, s in parts:
        q, scale = quantize_block_fp8(part)
        w.copy_(q)
        s.copy_(scale)


def fp8_views(model: CausalLM, name: str, shard: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight and scale views that checkpoint shard `shard` of parameter `name` fills (m06's shards)."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    weight, scale = module.get_parameter(name.rsplit(".", 1)[1]), module.get_parameter(name.rsplit(".", 1)[1] + "_scale_inv")
    if isinstance(module, FP8Linear):
        return module.shard(PACKED_SHARD[shard[0]]) if shard else (weight, scale)
    if not shard:                                       # a fused expert tensor of the hub layout
        return weight, scale
    _, e, part = shard
    if part == "down":
        return weight[e], scale[e]
    inter, grid = weight.shape[1] // 2, scale.shape[1] // 2
    return (weight[e, :inter], scale[e, :grid]) if part == "gate" else (weight[e, inter:], scale[e, grid:])


def fp8_checkpoint_modules(model: CausalLM, path) -> set[str]:
    """The modules of `model` whose every checkpoint key ships a weight_scale_inv with 128 x 128 blocks (k05's block):
    those run in FP8; the rest (none, for another block size) are dequantized by the loader."""
    from pathlib import Path
    from safetensors import safe_open
    if fp8_block_size(model.config) != (FP8_BLOCK, FP8_BLOCK):
        return set()
    keys = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    scaled, plain = set(), set()
    for key in keys:
        if key.endswith("_scale_inv") or (mapped := map_checkpoint_key(key)) is None:
            continue
        module = mapped[0].rsplit(".", 1)[0]
        (scaled if key + "_scale_inv" in keys else plain).add(module)
    return scaled - plain


@torch.no_grad()
def load_fp8_checkpoint(model: CausalLM, path) -> None:
    """m06's load_checkpoint for a model that use_fp8 converted: a key whose parameter is FP8 has its float8 bytes
    and its scale copied as they are (into the shard's weight rows and scale rows: no dequantize round trip); every
    other key goes through m06's path (dequantized with its scale when it has one). CheckpointError as m06."""
    from contextlib import ExitStack
    from pathlib import Path
    from safetensors import safe_open
    params = dict(model.named_parameters())
    fp8 = {name for name, p in params.items() if p.dtype == FP8}
    filled = {name: 0 for name in params}
    block = fp8_block_size(model.config)
    tied = getattr(model.config, "tie_word_embeddings", False)
    with ExitStack() as stack:
        where = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            f = stack.enter_context(safe_open(file, framework="pt"))
            where.update({key: (f, file) for key in f.keys()})
        if not where:
            raise CheckpointError(f"no *.safetensors files in {path}")
        for key, (f, file) in where.items():
            if key.endswith("_scale_inv") and key.removesuffix("_scale_inv") in where:
                continue
            mapped = map_checkpoint_key(key)
            if mapped is None or (mapped[0] == "lm_head.weight" and tied):
                continue
            if key.endswith("_scale_inv"):        # a scale whose weight is not in the checkpoint (m06's rule)
                raise CheckpointError(f"stray scale {key!r}: no weight {key.removesuffix('_scale_inv')!r} beside it "
                                      f"in the checkpoint ({file.name})")
            name, shard = mapped
            if name not in params:
                raise CheckpointError(f"unexpected key {key!r} (mapped to {name!r}) in {file.name}")
            tensor = f.get_tensor(key)
            scale = where[key + "_scale_inv"][0].get_tensor(key + "_scale_inv") if key + "_scale_inv" in where else None
            if name in fp8:
                if scale is None:
                    raise CheckpointError(f"{key!r} has no {key + '_scale_inv'!r}: the engine holds {name!r} in FP8")
                targets = fp8_views(model, name, shard)
                for got, target, what in ((tensor, targets[0], key), (scale, targets[1], key + "_scale_inv")):
                    if got.shape != target.shape:
                        raise CheckpointError(f"shape mismatch for {what!r}: checkpoint {list(got.shape)}, "
                                              f"model {list(target.shape)}")
                    target.copy_(got)
                filled[name] += targets[0].numel()
                filled[name + "_scale_inv"] += targets[1].numel()
                continue
            if scale is not None:
                tensor = dequantize_block_fp8(tensor, scale, block)
            elif tensor.dtype == FP8:
                raise CheckpointError(f"float8 weight {key!r} has no {key + '_scale_inv'!r} in the checkpoint")
            target = shard_view(model, name, params[name].data, shard)
            if tensor.shape != target.shape:
                raise CheckpointError(f"shape mismatch for {key!r}: checkpoint {list(tensor.shape)}, "
                                      f"model {name!r}{list(shard) if shard else ''} {list(target.shape)}")
            target.copy_(tensor)
            filled[name] += target.numel()
    for name, param in params.items():
        if filled[name] != param.numel():
            raise CheckpointError(f"missing key for {name!r}: {filled[name]} of {param.numel()} values loaded")


# ----------------------------------------------------------------------------- building on the device
def build_on_device(model, dtype: torch.dtype, device: torch.device, seed: int = 0,
                    quantization: str | None = None, before_allocating=None) -> tuple[CausalLM, object]:
    """An m06 model built directly on `device` in `dtype`: from an HF folder, or a config with dummy weights.

    The parameters are first built on the meta device (no bytes; buffers such as RoPE's cache on `device`), the FP8
    ones converted there (use_fp8), and `before_allocating(model)` may refuse what will not fit (the memory plan's
    precheck). Only then is each parameter allocated, in its final dtype: a weight that will be FP8 never exists on
    the device in `dtype`. quantization "fp8" / "w8a8" (fp8_mode): an FP8 checkpoint's bytes and scales are copied
    as they are; dummy weights are drawn in `dtype` one tensor at a time and quantized on the device (dummy_weights_)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoTokenizer
    from pathlib import Path
    tokenizer, path = None, None
    if isinstance(model, (str, Path)):
        path, model = Path(model), AutoConfig.from_pretrained(model)
        if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), init_empty_weights(include_buffers=False):
            built = build_model(model)
    finally:
        torch.set_default_dtype(default)
    if getattr(built.config, "tie_word_embeddings", False):  # init_empty_weights re-registers (unties) lm_head.weight
        built.lm_head.weight = built.model.embed_tokens.weight
    act_fp8 = quantization == "w8a8"
    if quantization:
        use_fp8(built, act_fp8, only=fp8_checkpoint_modules(built, path) if path is not None else None)
    if before_allocating is not None:
        before_allocating(built)
    materialize_(built, device)
    if path is not None and quantization:
        load_fp8_checkpoint(built, path)
    elif path is not None:
        load_checkpoint(built, path)
    else:
        dummy_weights_(built, seed)
    return built.eval(), tokenizer


@torch.no_grad()
def materialize_(model: nn.Module, device: torch.device) -> None:
    """Every parameter still on the meta device -> an uninitialised one of the same shape and dtype on `device`.
    A parameter shared by several modules (tied embeddings) stays shared."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                          requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]


def fp8_mode(model, quantization: str | None, device: torch.device, tensor_parallel_size: int) -> str | None:
    """LLM's quantization setting resolved: "auto" -> "fp8" for a folder whose config.json says quant_method "fp8"
    (weight-only FP8 GEMMs) on CUDA at TP=1, else None (an FP8 checkpoint is then dequantized by m06's loader);
    "fp8" / "w8a8" (activations quantized per token group too) on CUDA at TP=1 only; None: never."""
    if quantization not in ("auto", None, "fp8", "w8a8"):
        raise ValueError(f"quantization must be 'auto', None, 'fp8' or 'w8a8', got {quantization!r}")
    if quantization == "auto":
        import json
        from pathlib import Path
        config = Path(model) / "config.json" if isinstance(model, (str, Path)) else None
        method = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method") \
            if config is not None and config.exists() else None
        return "fp8" if method == "fp8" and device.type == "cuda" and tensor_parallel_size == 1 else None
    if quantization and (device.type != "cuda" or tensor_parallel_size != 1 or isinstance(model, nn.Module)):
        raise ValueError(f"quantization={quantization!r} runs on CUDA at tensor_parallel_size=1, on a model folder "
                         "or config (k05's FP8 kernels)")
    return quantization


@torch.no_grad()
def dummy_weights_(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """m06's dummy-weight recipe, drawn on the model's own device (a 35B model never touches host memory). An FP8
    parameter (use_fp8) gets the values its model-dtype weight would have, quantized shard by shard with k05's
    quantize_block_fp8 into it and its scales: the same bytes as use_fp8(quantize=True) on the model-dtype model,
    with one model-dtype tensor alive at a time."""
    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        parent, _, leaf = name.rpartition(".")
        if leaf.endswith("_scale_inv"):
            continue                                  # filled with its weight
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        if p.dtype == FP8:
            _quantize_into(model.get_submodule(parent), leaf, (noise * std).to(dtype))
        elif "norm" in name:
            base = 0.0 if isinstance(model.get_submodule(parent), GemmaRMSNorm) else 1.0
            p.copy_(base + 0.1 * noise)
        elif leaf == "A_log":
            p.copy_((noise.abs() * 5 + 1).clamp(1, 16).log())
        elif leaf == "dt_bias":
            p.fill_(1.0)
        else:
            p.copy_(noise * std)
        del noise


# ----------------------------------------------------------------------------- sampling on the device
@triton.jit(do_not_specialize=["seed"])   # a fresh random seed every step: no recompile when it is 1 or % 16 == 0
def _sample_kernel(logits_ptr, stride, temp_ptr, out_ptr, seed, vocab, BLOCK: tl.constexpr):
    """One row per program, one pass over the vocabulary: argmax of x / T + Gumbel noise (argmax of x for T = 0)."""
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        if t > 0:
            u = tl.rand(seed, row * vocab + offs)                     # U[0, 1), a counter-based stream
            x = x / t - tl.log(-tl.log(u))                           # + Gumbel(0, 1)
        take = x > best_val                                          # strict: the first max wins, like argmax
        best_val = tl.where(take, x, best_val)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best_val, axis=0)
    first = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


class DeviceSampler(Sampler):
    """e01's sampler (same contract) with a fast path for the common case.

    Rows without top-k / top-p / min-p and without a per-request seed need neither the vocabulary sort nor
    the [B, V] fp32 softmax: e01's exponential race argmax(p / q), q ~ Exp(1), is argmax(x / T - log q), and
    -log q with q = -log U is Gumbel noise. One Triton pass over the bf16 logits draws it from a
    counter-based stream seeded from torch's global RNG (so torch.manual_seed still reproduces a run) and
    takes the argmax; greedy rows (T = 0) take the plain argmax in the same pass, first index on ties. A
    batch with any seeded or filtered row runs e01's path, whose seeded streams are the request's own.
    """

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [B, V] on the device -> token ids [B] (int64, on the device). A row with top-k / top-p /
        min-p or its own generator sends the whole batch to e01's path; otherwise one _sample_kernel launch
        (temperatures as a [B] fp32 tensor, the seed drawn on the host from torch's global RNG, BLOCK=2048)."""
        if any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params) or any(g is not None for g in generators):
            return super().__call__(logits, params, generators)
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(logits.device, non_blocking=True)
        seed = int(torch.randint(0, 2**31 - 1, (1,)))                 # host RNG draw: no device sync
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        _sample_kernel[(logits.shape[0],)](logits, logits.stride(0), temps, out, seed, logits.shape[-1],
                                           BLOCK=2048, num_warps=8)
        return out


# ----------------------------------------------------------------------------- placeholder tokens (async scheduling)
def use_placeholders(model: CausalLM, rows: int) -> torch.Tensor:
    """Let the model take token ids that only the device knows yet: an id -(r + 2) is read from row r of the returned
    [rows] int64 buffer (the tokens the previous step sampled, written there by LLM.step; -1 is left out: e03 uses
    it as "no eos"). One buffer per model, read by a hook on its embedding, so a CUDA graph captured afterwards reads
    it too; ids >= 0 pass unchanged."""
    buf = getattr(model, "placeholder_tokens", None)
    device = model.model.embed_tokens.weight.device
    if buf is None or buf.numel() < rows or buf.device != device:
        model.placeholder_tokens = torch.zeros(max(rows, 1), dtype=torch.int64, device=device)
    if getattr(model, "placeholder_hook", None) is None:
        def fill(_embedding, args):
            ids = args[0]
            return (torch.where(ids < 0, model.placeholder_tokens[(-2 - ids).clamp(min=0)], ids),) + args[1:]
        model.placeholder_hook = model.model.embed_tokens.register_forward_pre_hook(fill)
    return model.placeholder_tokens


# ----------------------------------------------------------------------------- the runner
def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a captured graph: 1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


class GPUModelRunner(ModelRunner):
    """e04's runner with a CUDA backend: device KV cache and state pool, Triton layers, CUDA-graph decode."""

    def __init__(self, model: CausalLM, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, num_blocks: int | None = None, plan: MemoryPlan | None = None,
                 enforce_eager: bool = False):
        """num_blocks None: sized by `plan` (course/runtime/memory.py) from a profile run: the activation peak of a
        max_num_batched_tokens prefill and of the sampler, and the decode forward the CUDA graphs will hold, are
        measured on a small KV cache first; then the real cache takes what the plan leaves."""
        self.model, self.block_size, self.max_num_seqs = model, block_size, max_num_seqs
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # the GDN state pool before the KV cache: a fixed size the plan counts (one spare row for graph padding)
        with torch.device(self.device):
            self.gdn_pool = GDNStatePool(model, max_num_seqs + 1, self.dtype) if model.linear_layer_ids else None
        profile = num_blocks is None
        if profile and plan is None:
            raise ValueError("GPUModelRunner needs num_blocks or a memory plan")
        # the profile run's cache: the largest prefill step's tokens plus a partial block for each of its sequences
        self.num_blocks = -(-max_num_batched_tokens // block_size) + max_num_seqs + 1 if profile else num_blocks
        self.kv_caches = self._kv_caches(self.num_blocks)
        # the decode kernel's grid is fixed by its number of key partitions: at most one per 256 keys
        self.max_splits = max(1, min(16, -(-max_model_len // 256)))
        use_kernels(model, self.kv_caches, num_splits=self.max_splits)
        use_fused_mlp(model)
        self.generators: dict[int, torch.Generator | None] = {}
        self.sampler = DeviceSampler()
        self.last_was_decode = False
        # one pinned staging buffer: [ids | positions | slots | context_lens | gdn_slots | block tables]; two of
        # them, used in turn by overlapped steps (LLM.step): a step writes the one whose copy finished a step ago
        width = 5 + self.max_blocks_per_seq
        self.hosts = [torch.zeros(max(max_num_batched_tokens, max_num_seqs) * width + 4 * max_num_seqs + 8
                                  + 2 * (max_num_batched_tokens // CHUNK + max_num_seqs),       # the chunk table
                                  dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host = self.hosts[0]
        self.token_hosts = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]  # D2H
        self.placeholder_tokens = use_placeholders(model, max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._warm_up_moe(max(max_num_batched_tokens, max_num_seqs))
        if profile:
            self._size_kv_cache(plan, max_num_batched_tokens, max_model_len, enforce_eager)
        if not enforce_eager:
            self.capture_cudagraphs()
            self.capture_moe_graphs(max_num_batched_tokens)
        if profile:              # the largest step once more: its activations stay reserved, as the plan counts them
            self.profile_run(max_num_batched_tokens, max_model_len)
            plan.measured["free_after_warmup"] = memory.free_within(plan.budget, self.device)
            plan.measured["allocator_reserved"] = torch.cuda.memory_reserved(self.device)

    def _kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caches = []
        for layer in self.model.model.layers:
            if not layer.is_linear:
                attn = getattr(layer.self_attn, "inner", layer.self_attn)
                b = attn.attn
                shape = (num_blocks, self.block_size, b.num_kv_heads, b.head_dim)
                caches.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                               torch.zeros(shape, dtype=self.dtype, device=self.device)))
        return caches

    def _size_kv_cache(self, plan: MemoryPlan, max_tokens: int, max_model_len: int, enforce_eager: bool) -> None:
        """Measure the activation peak (profile_run) and the decode forward the graphs will hold, then replace the
        profile's small KV cache with the one the plan sizes (refused before allocating when it holds less than one
        max_model_len sequence)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.profile_run(max_tokens, max_model_len)
        plan.activations = torch.cuda.max_memory_allocated(dev) - base
        if not enforce_eager:       # the decode graphs' pool holds about one eager decode forward at max_num_seqs
            torch.cuda.reset_peak_memory_stats(dev)
            self.profile_run(self.max_num_seqs, max_model_len, decode=True, sample=False)
            plan.graphs = torch.cuda.max_memory_allocated(dev) - base
            moe = next((layer.mlp for layer in self.model.model.layers if isinstance(layer.mlp, KernelMoE)), None)
            if moe is not None:     # the MoE graphs' pool: one layer at the largest bucket, and its static in / out
                torch.cuda.reset_peak_memory_stats(dev)
                moe.eager(torch.zeros(max_tokens, self.model.config.hidden_size, dtype=self.dtype, device=dev))
                plan.graphs += torch.cuda.max_memory_allocated(dev) - base
                plan.graphs += 2 * max_tokens * self.model.config.hidden_size * self.dtype.itemsize
        self.kv_caches = None
        for b in self._attention_backends():
            b.k_cache = b.v_cache = None
        torch.cuda.empty_cache()
        plan.outside = memory.used_outside_allocator(dev)
        plan.block_size = self.block_size
        plan.block_bytes = memory.kv_block_bytes(self.model, self.block_size, self.dtype)
        blocks = plan.blocks_that_fit()
        if blocks < self.max_blocks_per_seq:
            memory.refuse(plan, f"一条 max_model_len 的序列（{self.max_blocks_per_seq} 块）的 KV cache ",
                          (self.max_blocks_per_seq - max(blocks, 0)) * plan.block_bytes, max_model_len,
                          self.max_num_seqs, "分配 KV cache 之前")
        plan.num_blocks = self.num_blocks = blocks
        self.kv_caches = self._kv_caches(blocks)
        for b, (k, v) in zip(self._attention_backends(), self.kv_caches):
            b.k_cache, b.v_cache = k, v

    def _attention_backends(self) -> list:
        return [layer.self_attn.inner.attn for layer in self.model.model.layers if not layer.is_linear]

    @torch.inference_mode()
    def profile_run(self, tokens: int, max_model_len: int, decode: bool = False, sample: bool = True) -> None:
        """One eager step of `tokens` tokens on throw-away sequences (prompts of at most max_model_len tokens, random
        ids, blocks 0.. of the cache, GDN slots taken and given back), then the sampler on max_num_seqs rows through
        e01's path (top-p: the [B, V] sort): the step the engine's activations peak at. decode: `tokens` one-token
        rows each reading one block. Nothing of it stays: no block is registered, every slot goes back."""
        gen = torch.Generator().manual_seed(0)
        vocab = self.model.config.vocab_size
        sizes = [1] * tokens if decode else [min(max_model_len, tokens - i) for i in range(0, tokens, max_model_len)]
        sizes = sizes[:self.max_num_seqs]                  # no step schedules more sequences
        seqs, block = [], 0
        for n in sizes:
            seq = Sequence(torch.randint(0, vocab, (n + (1 if decode else 0),), generator=gen).tolist())
            need = -(-seq.num_tokens // self.block_size)
            seq.block_table = [(block + i) % self.num_blocks for i in range(need)]
            block += need
            seq.num_cached_tokens = seq.num_tokens - 1 if decode else 0
            seq.num_scheduled_tokens = 1 if decode else n
            if decode and self.gdn_pool is not None:
                self.gdn_pool.allocate(seq)
            seqs.append(seq)
        try:
            if decode:
                self._run_decode(seqs)                     # eager: no graph is captured yet
            else:
                self._run_prefill(seqs)
            if not sample:
                return
            logits = torch.zeros(self.max_num_seqs, vocab, dtype=self.dtype, device=self.device)
            Sampler.__call__(self.sampler, logits, [SamplingParams(temperature=1.0, top_p=0.9)] * self.max_num_seqs,
                             [None] * self.max_num_seqs)
        finally:
            for seq in seqs:
                if self.gdn_pool is not None:
                    self.gdn_pool.free(seq)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _warm_up_moe(self, max_tokens: int) -> None:
        """Run one MoE layer (and each FP8 linear shape) at 1, 2, 4, ..., max_tokens tokens before serving starts. k03 picks its tile size from the
        token count and Triton compiles a kernel per tile size (0.1-1 s each): without this, the first step of each size
        class pays that compile while serving (seen on the H200: three k03 kernels compiled inside a timed multiturn
        run). Each of k03's size classes (pick_block_m) spans at least a factor of 2 in tokens: the powers of 2 reach all."""
        gen = torch.Generator(device=self.device).manual_seed(0)          # leaves torch's global RNG untouched
        # k05's FP8 linears pick their tiles from the token count too: one of each distinct shape (a prefill above 256
        # tokens compiled _fp8_linear_kernel inside a timed H200 run before this)
        shapes = {(m.in_features, tuple(m.shard_rows), m.act_fp8): m for m in self.model.modules()
                  if isinstance(m, FP8Linear)}
        moe = next((layer.mlp for layer in self.model.model.layers if isinstance(layer.mlp, KernelMoE)), None)
        hidden = self.model.config.hidden_size
        n = 1
        while shapes or moe is not None:                                  # .eager: no TP hooks, no collectives
            for linear in shapes.values():
                linear(torch.randn(min(n, max_tokens), linear.in_features, generator=gen,
                                   device=self.device).to(self.dtype))
            if moe is not None:
                moe.eager(torch.randn(min(n, max_tokens), hidden, generator=gen, device=self.device).to(self.dtype))
            if n >= max_tokens:
                break
            n *= 2

    @torch.inference_mode()
    def capture_moe_graphs(self, max_tokens: int) -> None:
        """A CUDA graph of every MoE layer at every moe_buckets size, for the eager steps (prefill, mixed): one graph
        launch replaces ~20 launches per layer. Every layer's graphs read one static input
        and write one static output (replays are sequential: each output is consumed before the next replay), and
        share one memory pool, largest bucket first. vLLM gets the same from piecewise CUDA graphs
        (vllm/compilation/cuda_graph.py: the attention ops stay eager, everything between them is replayed)."""
        moes = [layer.mlp for layer in self.model.model.layers if isinstance(layer.mlp, KernelMoE)]
        if not moes:
            return
        buckets = moe_buckets(max_tokens)
        hidden = self.model.config.hidden_size
        static_in = torch.zeros(buckets[-1], hidden, dtype=self.dtype, device=self.device)
        static_out = torch.zeros_like(static_in)
        pool = None
        for bucket in reversed(buckets):
            moes[0].eager(static_in[:bucket])                 # cuBLAS picks its kernels outside the capture
            torch.cuda.synchronize(self.device)
            for moe in moes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    static_out[:bucket] = moe.eager(static_in[:bucket])
                pool = graph.pool()
                moe.graphs[bucket] = graph
        for moe in moes:
            moe.buckets, moe.io = buckets, (static_in, static_out)
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ staging: one H2D copy per step
    def _stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy int arrays into the pinned buffer, move it with one non-blocking copy, return device views."""
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        host = self.host[:total].numpy()
        offset = 0
        for a in arrays:
            host[offset:offset + a.size] = a.reshape(-1)
            offset += a.size
        dev = self.host[:total].to(self.device, non_blocking=True)
        return list(dev.split(sizes))

    def _decode_inputs(self, seqs: list[Sequence], rows: int):
        """Host arrays of a decode batch padded to `rows` (padding: slot -1, context 0, block -1). Built with
        whole-array numpy operations: a Python loop writing 256 rows element by element costs ~0.5 ms a step."""
        n, P = len(seqs), self.block_size
        num_blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
        width = self.max_blocks_per_seq
        ids = np.zeros(rows, np.int64)
        pos = np.zeros(rows, np.int64)
        ids[:n] = [s.last_token for s in seqs]
        pos[:n] = [s.num_cached_tokens for s in seqs]
        tables = np.full((rows, width), -1, np.int64)
        tables[:n][np.arange(width) < num_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(s.block_table for s in seqs), np.int64, int(num_blocks.sum()))
        slots = np.full(rows, -1, np.int64)
        slots[:n] = tables[np.arange(n), pos[:n] // P] * P + pos[:n] % P
        lens = np.zeros(rows, np.int64)
        lens[:n] = pos[:n] + 1
        gdn = np.full(rows, -1, np.int64)
        if self.gdn_pool is not None:
            gdn[:n] = self._gdn_slots(seqs)
        return [ids, pos, slots, lens, gdn, tables]

    def _gdn_slots(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's pool slot; a sequence starting its prefill gets a fresh zeroed one."""
        pool = self.gdn_pool
        for s in seqs:
            if s.seq_id not in pool.slot_of:
                if s.num_cached_tokens:
                    raise RuntimeError(f"sequence {s.seq_id} resumes at token {s.num_cached_tokens} without a "
                                       "GDN state (prefix caching must be off for hybrid models)")
                pool.allocate(s)
        return [pool.slot_of[s.seq_id] for s in seqs]

    def _states(self, slots: torch.Tensor, decode: bool, num_decodes: int = 0, prefill_cu: torch.Tensor | None = None,
                chunks: tuple[torch.Tensor, torch.Tensor] | None = None,
                prefill_slots: torch.Tensor | None = None) -> dict[int, PoolState] | None:
        if self.gdn_pool is None:
            return None
        p = self.gdn_pool
        return {i: PoolState(p.conv[i], p.ssm[i], slots, decode, num_decodes=num_decodes, prefill_cu=prefill_cu,
                             prefill_slots=prefill_slots, chunks=chunks) for i in p.conv}

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """One graph per batch bucket, largest first so the smaller ones reuse its memory pool."""
        rows, M = self.max_num_seqs, self.max_blocks_per_seq
        dev = self.device
        self.static = {
            "ids": torch.zeros(rows, dtype=torch.int64, device=dev),
            "pos": torch.zeros(rows, dtype=torch.int64, device=dev),
            "slots": torch.full((rows,), -1, dtype=torch.int64, device=dev),
            "lens": torch.zeros(rows, dtype=torch.int32, device=dev),
            "gdn": torch.full((rows,), -1, dtype=torch.int32, device=dev),
            "tables": torch.full((rows, M), -1, dtype=torch.int32, device=dev),
            "cu": torch.arange(rows + 1, dtype=torch.int32, device=dev),
            "out": torch.zeros(rows, self.model.config.hidden_size, dtype=self.dtype, device=dev),
        }
        pool = None
        backends = [layer.self_attn.inner.attn for layer in self.model.model.layers if not layer.is_linear]
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
        for bs in reversed(batch_buckets(self.max_num_seqs)):
            for b in backends:   # split-K only where (sequences x kv heads) leaves the SMs idle; fixed per graph
                b.num_splits = max(1, min(self.max_splits, -(-2 * sm_count // (bs * b.num_kv_heads))))
            ctx, states = self._static_ctx(bs)
            s = self.static
            for _ in range(2):                                   # warm up: Triton compiles outside the capture
                s["out"][:bs] = self.model(s["ids"][:bs], s["pos"][:bs], ctx, states)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                s["out"][:bs] = self.model(s["ids"][:bs], s["pos"][:bs], ctx, states)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(dev)

    def _static_ctx(self, bs: int):
        s = self.static
        ctx = AttentionContext(cu_seqlens_q=s["cu"][:bs + 1], cu_seqlens_k=s["cu"][:bs + 1], max_seqlen_q=1,
                               max_seqlen_k=self.max_blocks_per_seq * self.block_size,
                               slot_mapping=s["slots"][:bs], block_tables=s["tables"][:bs],
                               context_lens=s["lens"][:bs], is_prefill=False)
        return ctx, self._states(s["gdn"][:bs], decode=True)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        done, sampled = self.launch(seqs)
        tokens = [-1] * len(seqs)
        if done:
            for i, token in zip(done, sampled.tolist()):                          # the step's one D2H copy
                tokens[i] = token
        return tokens

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """One step up to the sampled tokens, without waiting for them: (the rows that sample, their tokens [len(done)]
        on the device). run() = launch() + one .tolist(); LLM.step's overlapped decode steps take the device tensor."""
        decode = self.last_was_decode = all(s.num_scheduled_tokens == 1 for s in seqs)
        if decode:
            hidden = self._run_decode(seqs)
            last_rows = None
        else:
            hidden, last_rows = self._run_prefill(seqs)
        done = [i for i, s in enumerate(seqs) if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens]
        if not done:
            return done, None
        if last_rows is None:                        # decode: every row samples; a list index would sync
            rows = hidden if len(done) == len(seqs) else hidden[done]
        else:
            rows = hidden[last_rows[done]]
        logits = self.model.compute_logits(rows)                                  # [B_done, V]
        for i in done:
            if seqs[i].seq_id not in self.generators:
                self.generators[seqs[i].seq_id] = make_generator(seqs[i].sampling_params.seed, self.device)
        sampled = self.sampler(logits, [seqs[i].sampling_params for i in done],
                               [self.generators[seqs[i].seq_id] for i in done])
        return done, sampled

    def _run_decode(self, seqs: list[Sequence]) -> torch.Tensor:
        n = len(seqs)
        bs = next((b for b in sorted(self.graphs) if b >= n), None)
        rows = bs if bs is not None else n
        ids, pos, slots, lens, gdn, tables = self._stage(self._decode_inputs(seqs, rows))
        tables = tables.view(rows, self.max_blocks_per_seq)
        if bs is None:                                                            # eager (enforce_eager)
            ctx = AttentionContext(cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=self.device),
                                   cu_seqlens_k=None, max_seqlen_q=1, max_seqlen_k=int(lens.max()),
                                   slot_mapping=slots, block_tables=tables.int(), context_lens=lens.int(),
                                   is_prefill=False)
            return self.model(ids, pos, ctx, self._states(gdn.int(), decode=True))
        s = self.static                                  # the graph reads these addresses: copy INTO them
        s["ids"][:bs].copy_(ids)
        s["pos"][:bs].copy_(pos)
        s["slots"][:bs].copy_(slots)
        s["lens"][:bs].copy_(lens)
        s["gdn"][:bs].copy_(gdn)
        s["tables"][:bs].copy_(tables)
        self.graphs[bs].replay()
        return s["out"][:n]

    def _prefill_inputs(self, seqs: list[Sequence]) -> list[np.ndarray]:
        """e04's prepare_batch (same arrays, same order as its tensors) in numpy, plus the GDN slots:
        [ids, positions, cu_q, cu_k, slots, block tables [B, M], context lens, gdn]. Torch's CPU ops on
        [16k]-long index tensors cost ~10 ms a prefill step on the H200's host, numpy's well under 1 ms:
        that time is spent before the first kernel of the step starts, with the GPU idle."""
        n, P = len(seqs), self.block_size
        cached = np.fromiter((s.num_cached_tokens for s in seqs), np.int64, n)
        new = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int64, n)
        cu_q = np.zeros(n + 1, np.int64)
        np.cumsum(new, out=cu_q[1:])
        ids = np.fromiter(itertools.chain.from_iterable(
            s.token_ids[s.num_cached_tokens:s.num_cached_tokens + s.num_scheduled_tokens] for s in seqs),
            np.int64, int(cu_q[-1]))
        seq_of_token = np.repeat(np.arange(n), new)
        positions = np.arange(int(cu_q[-1])) - cu_q[seq_of_token] + cached[seq_of_token]
        num_blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
        width = int(num_blocks.max())
        tables = np.full((n, width), -1, np.int64)
        tables[np.arange(width) < num_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(s.block_table for s in seqs), np.int64, int(num_blocks.sum()))
        slots = tables[seq_of_token, positions // P] * P + positions % P
        lens = cached + new
        cu_k = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=cu_k[1:])
        gdn = np.asarray(self._gdn_slots(seqs) if self.gdn_pool is not None else [-1] * n, np.int64)
        return [ids, positions, cu_q, cu_k, slots, tables, lens, gdn]

    def _run_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        arrays = self._prefill_inputs(seqs)
        host_q, host_lens = arrays[2], arrays[6]
        new = np.diff(host_q)                                          # tokens of each sequence this step
        table_shape, max_q, max_k = arrays[5].shape, int(new.max()), int(host_lens.max())
        ones = new == 1
        d = 0 if ones.all() else int(ones.argmin())                    # leading one-token rows: the decodes
        gdn = self.gdn_pool is not None
        chunk_arrays = list(chunk_table(host_q[d:] - host_q[d])) if gdn else []   # of the prefill rows
        ids, pos, cu_q, cu_k, slots, tables, lens, gdn_dev, *chunks = self._stage(arrays + chunk_arrays)
        chunks = tuple(t.int() for t in chunks) or None
        whole = dict(cu_seqlens_q=cu_q.int(), cu_seqlens_k=cu_k.int(), max_seqlen_q=max_q, max_seqlen_k=max_k,
                     slot_mapping=slots, block_tables=tables.view(table_shape).int(), context_lens=lens.int())
        if d == 0:
            dctx = AttentionContext(**whole, is_prefill=True)
            states = self._states(gdn_dev.int(), decode=False, chunks=chunks)
        else:                  # a mixed step: the decode rows keep the decode kernels (e03 schedules them first)
            dctx, states = self._mixed(whole, d, host_q, host_lens, gdn_dev.int(), chunks)
        hidden = self.model(ids, pos, dctx, states)
        return hidden, (cu_q[1:] - 1)

    def _mixed(self, whole: dict, d: int, host_q: np.ndarray, host_lens: np.ndarray, gdn: torch.Tensor, chunks):
        """The context and GDN states of a step whose first d sequences decode: views of the whole batch's tensors."""
        cu_q, cu_k, lens = whole["cu_seqlens_q"], whole["cu_seqlens_k"], whole["context_lens"]
        tables, slots = whole["block_tables"], whole["slot_mapping"]
        decode = AttentionContext(cu_seqlens_q=cu_q[:d + 1], cu_seqlens_k=None, max_seqlen_q=1,
                                  max_seqlen_k=int(host_lens[:d].max()), slot_mapping=slots[:d],
                                  block_tables=tables[:d], context_lens=lens[:d], is_prefill=False)
        prefill_cu = cu_q[d:] - d
        prefill = AttentionContext(cu_seqlens_q=prefill_cu, cu_seqlens_k=cu_k[d:] - cu_k[d],
                                   max_seqlen_q=int((host_q[d + 1:] - host_q[d:-1]).max()),
                                   max_seqlen_k=int(host_lens[d:].max()), slot_mapping=slots[d:],
                                   block_tables=tables[d:].clone(), context_lens=lens[d:], is_prefill=True)
        ctx = MixedContext(**whole, is_prefill=True, decode=decode, prefill=prefill, num_decodes=d)
        # the prefill kernels get copies of the int tensors they index with, not views d rows in: a view's address
        # is 16-byte aligned or not depending on d, and Triton compiles a kernel per alignment (seen on an H200: the
        # first mixed step of each new alignment compiled k02's and k04's prefill kernels inside a timed run)
        return ctx, self._states(gdn, decode=False, num_decodes=d, prefill_cu=prefill_cu, chunks=chunks,
                                 prefill_slots=gdn[d:].clone())


def chunk_table(cu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k04's _chunk_table in numpy, from the cu_seqlens the host already has: (sequence id, first token) of every
    CHUNK-token chunk. Built once per step and handed to every GDN layer, no layer waits for the GPU to count chunks
    (k04 alone would sync once per GDN layer: 30 times a step for Qwen3.5-35B-A3B)."""
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    seq = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return seq, cu[:-1][seq] + (np.arange(len(seq)) - first[seq]) * CHUNK


# ----------------------------------------------------------------------------- the engine
@dataclass
class Inflight:
    """A launched step whose tokens the host has not read yet."""
    seqs: list[Sequence]
    positions: list[int]            # index of each sequence's new token in its token_ids
    host: torch.Tensor              # [len(seqs)] int64, pinned: the tokens once `event` has completed
    event: object                   # torch.cuda.Event recorded after the copy (None on the CPU: already there)
    finished: set[int]              # seq ids e03 finished on the counts (max_tokens, max_model_len)


class LLM(CPULLM):
    """e05's engine with a device: `LLM(model, device="cuda")` runs GPUModelRunner, `device="cpu"` e04's runner.

    Extra settings: device (default CUDA when available), gpu_memory_utilization (KV cache from free memory
    when num_kvcache_blocks is None), enforce_eager (no CUDA graphs), tensor_parallel_size (one process per
    rank, rank r on cuda:r, NCCL; gloo on the CPU: course/runtime/tp_engine.py), async_scheduling (None: pure
    decode steps overlap the next step's host work with this step's GPU work where step() allows it; False: never).
    quantization (fp8_mode): "auto" serves an FP8 checkpoint with k05's FP8 GEMMs, "fp8" / "w8a8" force them (dummy
    weights quantized), None dequantizes. dtype defaults to bf16 on CUDA. With tensor_parallel_size > 1, close() (or `with LLM(...) as llm:`) stops the
    worker processes.
    """

    def __init__(self, model, tokenizer=None, device: str | torch.device | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 async_scheduling: bool | None = None, quantization: str | None = "auto", **kwargs):
        if async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None, got {async_scheduling!r}")
        self.async_scheduling = async_scheduling          # None: on where it applies (see step)
        self.inflight: Inflight | None = None
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        quantization = fp8_mode(model, quantization, device, tensor_parallel_size)
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        self.tp = None
        if tensor_parallel_size > 1:      # this process is rank 0 (or a worker): TP=1 never imports any of it
            from course.runtime.tp_engine import TensorParallel
            self.tp = TensorParallel.start(type(self), tensor_parallel_size, device, model, dict(
                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, **kwargs))
            device = self.tp.device                                     # cuda:rank
        if device.type != "cuda":
            if self.tp is not None:       # shard before e05 sizes the KV cache from the model's heads
                model, tokenizer = _load(model, tokenizer, EngineConfig(**kwargs))
                model = self.tp.shard(model)
            super().__init__(model, tokenizer, **kwargs)
            if self.tp is not None:
                if isinstance(self.runner, SnapshotRunner):
                    self.tp.close()
                    raise ValueError("prefix caching for hybrid models (GDN state snapshots) runs at "
                                     "tensor_parallel_size=1 only")
                self.runner = self.tp.attach(self.runner)
            return
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        num_blocks = kwargs.pop("num_kvcache_blocks", None)
        gpu_memory_gib = kwargs.pop("gpu_memory_gib", None)
        kwargs.setdefault("dtype", torch.bfloat16)
        self.config = config = EngineConfig(num_kvcache_blocks=num_blocks or 1, **kwargs)
        # the memory plan (course/runtime/memory.py): given machinery, printed by run / serve / bench
        budget, card = memory.budget_bytes(device, gpu_memory_gib)
        self.memory_plan = plan = MemoryPlan(card, budget, gpu_memory_utilization,
                                             memory.used_outside_allocator(device), {}, 0, 0)
        if isinstance(model, nn.Module):
            self.model, self.tokenizer = model.to(device=device, dtype=config.dtype).eval(), tokenizer
        else:
            precheck = (lambda meta: self._precheck(meta, plan)) if num_blocks is None and self.tp is None else None
            self.model, loaded_tokenizer = build_on_device(model, config.dtype, device, config.seed, quantization,
                                                           before_allocating=precheck)
            self.tokenizer = tokenizer or loaded_tokenizer
        if self.tp is not None:           # the full model -> this rank's shard (m07), before the KV cache is sized
            self.model = self.tp.shard(self.model)
        hf_config = text_config(self.model.config)
        self.vocab_size = hf_config.vocab_size
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else getattr(hf_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        hybrid = bool(self.model.linear_layer_ids)
        prefix = (not hybrid) if config.enable_prefix_caching is None else config.enable_prefix_caching
        snapshots = hybrid and prefix      # e07: GDN state snapshots on the device
        if snapshots and self.tp is not None:
            self.tp.close()
            raise ValueError("prefix caching for hybrid models (GDN state snapshots) runs at tensor_parallel_size=1 only")
        state_cache = None
        if snapshots:                     # allocated before the KV cache is sized from the memory left
            with torch.device(device):
                state_cache = StateCache(self.model, config.num_state_snapshots, config.dtype)
        self._fixed_sizes(self.model, plan, state_cache)
        self.runner = GPUModelRunner(self.model, config.block_size, config.max_num_seqs, config.max_model_len,
                                     config.max_num_batched_tokens, num_blocks, plan, enforce_eager)
        if num_blocks is not None:
            plan.num_blocks, plan.block_size = num_blocks, config.block_size
            plan.block_bytes = memory.kv_block_bytes(self.model, config.block_size, config.dtype)
        if self.tp is not None:           # rank 0: every worker ready; KV blocks = the fewest any rank has
            self.runner = self.tp.attach(self.runner)
        config.num_kvcache_blocks = self.runner.num_blocks
        if snapshots:                     # restores are copies into the pool before the step: never inside a graph
            self.runner = SnapshotRunner(self.runner, state_cache)
            self.block_manager = HybridBlockManager(self.runner.num_blocks, config.block_size, state_cache)
        else:
            self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=prefix)
        self.scheduler = (HybridScheduler if snapshots else Scheduler)(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, eos_token_id=-1 if eos is None else int(eos),
            enable_chunked_prefill=config.enable_chunked_prefill), self.block_manager)
        self.requests: dict[int, Sequence] = {}

    # ------------------------------------------------------------------ the memory plan
    def _fixed_sizes(self, model: CausalLM, plan: MemoryPlan, state_cache: StateCache | None) -> None:
        """The plan's entries whose size the settings fix: weights by kind, GDN state rows, snapshot rows."""
        config = self.config
        plan.weights = memory.weight_bytes(model)
        row = memory.gdn_row_bytes(model, config.dtype)
        plan.gdn_rows = config.max_num_seqs + 1 if row else 0
        plan.gdn_pool = plan.gdn_rows * row
        hybrid = bool(model.linear_layer_ids)
        snapshots = hybrid and bool(config.enable_prefix_caching)
        plan.snapshot_rows = config.num_state_snapshots if snapshots else 0
        plan.snapshots = plan.snapshot_rows * row
        if state_cache is not None:
            plan.snapshots = sum(t.numel() * t.element_size() for pool in (state_cache.store.conv, state_cache.store.ssm)
                                 for t in pool.values())

    def _precheck(self, meta_model: CausalLM, plan: MemoryPlan) -> None:
        """Before any weight is allocated: weights (as they will be: FP8 ones as FP8), GDN rows, snapshots, an
        activation floor and one max_model_len sequence of K/V must fit, else MemoryPlanError with the numbers."""
        config = self.config
        self._fixed_sizes(meta_model, plan, None)
        plan.activations = memory.activation_floor(text_config(meta_model.config), config.max_num_batched_tokens,
                                                   config.max_num_seqs)
        per_seq = -(-config.max_model_len // config.block_size)
        plan.block_size = config.block_size
        plan.block_bytes = memory.kv_block_bytes(meta_model, config.block_size, config.dtype)
        if plan.blocks_that_fit() < per_seq:
            memory.refuse(plan, f"一条 max_model_len 的序列（{per_seq} 块）的 KV cache ",
                          (per_seq - max(plan.blocks_that_fit(), 0)) * plan.block_bytes, config.max_model_len,
                          config.max_num_seqs, "加载权重之前")
        plan.activations = 0                  # measured by the runner's profile run

    # ------------------------------------------------------------------ async scheduling
    def overlaps(self) -> bool:
        """Can the next step be launched before this one's tokens reach the host? Only a pure decode step of a
        GPUModelRunner at TP=1 without GDN snapshots (e07 keys snapshots by block hashes, which need the tokens),
        with nothing waiting and no prefill in progress: then schedule() needs no token value, only counts."""
        runner = self.runner
        if self.async_scheduling is False or type(runner) is not GPUModelRunner:
            return False
        if self.async_scheduling is None and not runner.graphs:
            return False
        sched = self.scheduler
        return (not sched.waiting and bool(sched.running)
                and all(s.num_tokens - s.num_cached_tokens == 1 for s in sched.running))

    def step(self) -> list[tuple[int, int, bool]]:
        """e05's step, overlapped where overlaps() allows: schedule and launch step N+1 while the GPU still runs step
        N, then wait for step N's tokens. Step N's sequences carry a placeholder -(row + 2) as their last token in the
        meantime (the embedding reads the real one on the device: use_placeholders); e03 finishes them on the counts
        (max_tokens, max_model_len), _resolve on the tokens (eos, stop tokens). Returns step N's events: one step
        late, so the first overlapped step returns none. vLLM: async scheduling (vllm/v1/core/sched/async_scheduler.py)."""
        if not self.overlaps():
            previous, self.inflight = self.inflight, None
            return self._resolve(previous) + super().step()
        seqs = self.scheduler.schedule()
        if self.runner.gdn_pool is not None:          # preempted hybrid sequences restart from a zero state
            for seq in self.scheduler.waiting:
                self.runner.release(seq)
        previous, self.inflight = self.inflight, None
        try:
            if seqs:
                self.inflight = self._launch(seqs)
        except BaseException:
            self._resolve(previous)                       # its tokens are real: the sequences stay consistent
            raise
        return self._resolve(previous)

    def _launch(self, seqs: list[Sequence]) -> "Inflight":
        runner = self.runner
        k = self.scheduler.num_steps % 2                  # this step's staging buffers: the other ones may be in flight
        runner.host = runner.hosts[k]
        done, sampled = runner.launch(seqs)
        n = len(seqs)
        assert len(done) == n, "an overlapped step samples every row"
        runner.placeholder_tokens[:n].copy_(sampled)      # what the next step's placeholders point at
        host = runner.token_hosts[k][:n]
        host.copy_(sampled, non_blocking=True)
        event = None
        if sampled.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        positions = [s.num_tokens for s in seqs]           # where each sequence's new token goes
        finished = self.scheduler.postprocess(seqs, [-(i + 2) for i in range(n)])
        for seq in finished:
            self.runner.release(seq)
        return Inflight(seqs, positions, host, event, {s.seq_id for s in finished})

    def _resolve(self, step: "Inflight | None") -> list[tuple[int, int, bool]]:
        """Step N's tokens into its sequences (in place of the placeholders); eos / stop tokens finish them now."""
        if step is None:
            return []
        if step.event is not None:
            step.event.synchronize()
        events = []
        eos = self.scheduler.config.eos_token_id
        for seq, pos, token in zip(step.seqs, step.positions, step.host.tolist()):
            if self.requests.get(seq.seq_id) is not seq or seq.num_tokens <= pos:
                continue                                  # aborted, or cut off by an earlier stop token
            seq.token_ids[pos] = token
            if pos == seq.num_tokens - 1:
                seq.last_token = token
            self._rehash(seq, pos)
            params = seq.sampling_params
            finished = seq.seq_id in step.finished
            if not finished and ((token == eos and not params.ignore_eos) or token in params.stop_token_ids):
                self._stop(seq, pos)
                finished = True
            events.append((seq.seq_id, token, finished))
        return events

    def _rehash(self, seq: Sequence, pos: int) -> None:
        """e02 registered the block this token filled while it was a placeholder: register it under its real hash."""
        bm = self.block_manager
        i = pos // bm.block_size
        if not bm.enable_prefix_caching or (pos + 1) % bm.block_size or i >= len(seq.block_table):
            return
        block = bm.blocks[seq.block_table[i]]
        if block.hash == -1 or not block.token_ids or block.token_ids[-1] >= 0:
            return
        tokens = seq.block(i)
        prefix = bm.blocks[seq.block_table[i - 1]].hash if i else -1
        bm._uncache_block(seq.block_table[i])
        bm._cache_block(seq.block_table[i], compute_block_hash(tokens, prefix), tokens)

    def _stop(self, seq: Sequence, pos: int) -> None:
        """A stop token at pos: the tokens after it (a placeholder already scheduled) go, and so does the sequence."""
        del seq.token_ids[pos + 1:]
        seq.num_tokens, seq.last_token = pos + 1, seq.token_ids[pos]
        if seq.status == SequenceStatus.FINISHED:         # e03 finished it on the counts a step later: done already
            return
        if seq.status == SequenceStatus.RUNNING:
            self.scheduler.running.remove(seq)
            self.block_manager.deallocate(seq)
        else:                                             # preempted meanwhile: its blocks went back then
            self.scheduler.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.runner.release(seq)

    def has_unfinished(self) -> bool:
        return self.inflight is not None or super().has_unfinished()

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do at TP=1)."""
        if self.tp is not None:
            self.tp.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["LLM", "GPUModelRunner", "PoolState", "KernelNorm", "KernelMoE", "KernelGDN", "KernelMLP", "use_kernels",
           "FP8Linear", "use_fp8", "load_fp8_checkpoint", "fp8_mode",
           "use_fused_mlp",
           "build_on_device", "dummy_weights_", "batch_buckets", "DeviceSampler"]
