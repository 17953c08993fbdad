"""M05 · Gated DeltaNet: causal conv, the gated delta rule (recurrent and chunked WY form), the layer.

The token mixer of Qwen3.5's linear-attention layers. Per value head it keeps a fixed-size state
S [dk, dv] instead of a growing KV cache:

    g_t    = -exp(A_log) * softplus(a_t + dt_bias)              log-decay, fp32, <= 0
    beta_t = sigmoid(b_t)                                       write strength in (0, 1)
    q_t, k_t = l2norm(q_t) * dk^-0.5, l2norm(k_t)               eps 1e-6 inside the rsqrt of the SUM
    S      = exp(g_t) * S                                       1. decay
    u_t    = beta_t * (v_t - k_t^T S)                           2. read what S predicts for k_t: the error
    S      = S + k_t u_t^T                                      3. write the correction
    o_t    = S^T q_t                                            4. read with the query

The chunked (WY) form computes the same thing chunk by chunk with a few matmuls: inside a chunk the
corrections u solve a unit lower-triangular system, and only the state crosses chunk boundaries.

Before the rule: a causal depthwise conv1d (kernel K, no bias) + silu over the packed [q | k | v]
channels, whose decode form keeps the last K-1 inputs of each sequence (conv_state).
After it: RMSNormGated per value head (w * norm(o) * silu(z)) and out_proj.

Shapes: N packed tokens of B sequences (cu_seqlens [B+1]), C = 2*nk*dk + nv*dv conv channels,
nk/nv key/value heads, dk/dv head dims, H (in the rule functions) = number of heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .m01_rmsnorm import RMSNormGated


def causal_conv1d(x: Tensor, weight: Tensor, cu_seqlens: Tensor,
                  conv_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Prefill: x [N, C] packed tokens, weight [C, K], cu_seqlens [B+1], conv_state [B, C, K-1] or None.

    Returns (silu(causal depthwise conv(x)) [N, C], new conv_state [B, C, K-1]). Output t of a
    sequence sees its inputs t-K+1..t, reaching into conv_state (zeros when None) before its start;
    the new state is the last K-1 inputs of each sequence, initial state included when it is short.
    """
    num_channels, width = weight.shape
    bounds = cu_seqlens.tolist()
    if conv_state is None:
        conv_state = x.new_zeros(len(bounds) - 1, num_channels, width - 1)
    out = torch.empty_like(x)
    new_state = torch.empty_like(conv_state)
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        seq = torch.cat([conv_state[i], x[start:end].T], dim=-1)               # [C, K-1+T]: past inputs, then ours
        y = F.conv1d(seq[None], weight[:, None, :], groups=num_channels)[0]    # [C, T]: no padding, y_t sees t-K+1..t
        out[start:end] = F.silu(y).T
        new_state[i] = seq[:, seq.shape[1] - (width - 1):]                     # last K-1 INPUTS (not outputs)
    return out, new_state


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor) -> Tensor:
    """Decode: x [B, C] (one token per sequence), conv_state [B, C, K-1] updated in place, weight [C, K].

    Returns silu(conv) [B, C] over the window [conv_state, x].
    """
    window = torch.cat([conv_state, x[:, :, None]], dim=-1)                    # [B, C, K]
    conv_state.copy_(window[:, :, 1:])                                         # drop the oldest input
    return F.silu((window * weight).sum(-1))                                   # [B, C]


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """a, b [N, nv]; A_log, dt_bias [nv] -> (g [N, nv] fp32 log-decay <= 0, beta [N, nv] in b.dtype)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b)
    return g, beta


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., d] -> fp32 x * rsqrt(sum(x^2, -1) + eps)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule (the decode form).

    q, k [B, T, H, dk] (L2-normalised; q already scaled by dk^-0.5), v [B, T, H, dv], g, beta [B, T, H],
    initial_state [B, H, dk, dv] or None (zeros). Returns (o [B, T, H, dv] in v.dtype, final state fp32).
    """
    batch, steps, heads, dk = k.shape
    dv, dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if initial_state is None:
        state = q.new_zeros(batch, heads, dk, dv)
    else:
        state = initial_state.float()
    out = v.new_empty(batch, steps, heads, dv)
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]                         # 1. decay       [B, H, dk, dv]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], state)                   # 2. k^T S       [B, H, dv]
        u = beta[:, t, :, None] * (v[:, t] - pred)                             #    correction  [B, H, dv]
        state = state + k[:, t, :, :, None] * u[:, :, None, :]                 # 3. S += k u^T
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)              # 4. o = S^T q
    return out.to(dtype), state


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The same rule in chunked WY form (the prefill form): matmuls inside a chunk, a loop over chunks.

    Same arguments and results as recurrent_gated_delta_rule. T need not be a multiple of chunk_size.
    """
    batch, steps, heads, dk = k.shape
    dv, dtype, size = v.shape[-1], v.dtype, chunk_size
    pad = (-steps) % size
    # [B, H, T', d] in fp32; padded steps have k = v = beta = g = 0, so they change nothing
    q, k, v = (F.pad(t.float().transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.float().transpose(1, 2), (0, pad)) for t in (g, beta))
    n = (steps + pad) // size
    q, k, v = (t.reshape(batch, heads, n, size, -1) for t in (q, k, v))      # [B, H, n, c, d]
    g, beta = g.reshape(batch, heads, n, size), beta.reshape(batch, heads, n, size)

    gamma = g.cumsum(-1)                                                       # log decay from chunk start to i
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., c, c]

    # u_i = beta_i (v_i - e^{gamma_i} k_i^T S0 - sum_{j<i} e^{gamma_i - gamma_j} (k_i.k_j) u_j)
    #  => (I + L) u = beta*v - (beta*e^gamma*k) S0, L strictly lower: solve once for all chunks
    k_beta = k * beta[..., None]
    system = torch.eye(size, device=q.device) + (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    u_local = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)           # [.., c, dv]
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False)      # [.., c, dk]

    attn = (q @ k.transpose(-1, -2)) * decay                                   # intra-chunk, diagonal included
    q_read = q * gamma.exp()[..., None]                                        # q_i reads S0 decayed to i
    k_write = k * (gamma[..., -1:] - gamma).exp()[..., None]                   # k_j written, decayed to chunk end
    chunk_decay = gamma[..., -1].exp()[..., None, None]                        # [B, H, n, 1, 1]

    if initial_state is None:
        state = q.new_zeros(batch, heads, dk, dv)
    else:
        state = initial_state.float()
    out = torch.empty_like(v)
    for c in range(n):
        u = u_local[:, :, c] - w[:, :, c] @ state                              # corrections     [B, H, c, dv]
        out[:, :, c] = q_read[:, :, c] @ state + attn[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(batch, heads, n * size, dv)[:, :, :steps].transpose(1, 2)  # [B, T, H, dv]
    return out.to(dtype), state


@dataclass
class GDNState:
    """Per-sequence state of one GatedDeltaNet layer for the B sequences of a batch, updated in place."""
    conv: Tensor   # [B, C, K-1]     last K-1 conv inputs of each sequence
    ssm: Tensor    # [B, nv, dk, dv] recurrent state, fp32


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention layer on packed sequences; parameter names as HF Qwen3_5GatedDeltaNet."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int, rms_norm_eps: float):
        """Parameters (names and shapes as HF, so loading a checkpoint is a name lookup):
        in_proj_qkv [C, hidden] (C = 2*nk*dk + nv*dv, rows [q_all | k_all | v_all]), in_proj_z [nv*dv, hidden],
        in_proj_b / in_proj_a [nv, hidden] (nn.Linear, no bias); conv1d depthwise nn.Conv1d, weight [C, 1, K],
        no bias; A_log, dt_bias [nv]; norm = RMSNormGated(dv, eps); out_proj [hidden, nv*dv].
        """
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)    # [q_all | k_all | v_all]
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
                                bias=False)                                    # weight [C, 1, K], used by hand
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.norm = RMSNormGated(head_v_dim, eps=rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: Tensor, cu_seqlens: Tensor, state: GDNState | None = None) -> Tensor:
        """hidden_states [N, hidden] (B packed sequences, cu_seqlens [B+1]) -> [N, hidden].

        state None: every sequence starts from zeros and nothing is kept. Otherwise state holds each
        sequence's conv / recurrent state and is overwritten with its final state; when every
        sequence brings exactly one token (decode) the single-step forms are used.
        """
        num_tokens = hidden_states.shape[0]
        num_seqs = cu_seqlens.numel() - 1
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        decode = state is not None and num_tokens == num_seqs
        mixed = self.in_proj_qkv(hidden_states)                                # [N, C]
        z = self.in_proj_z(hidden_states)                                      # [N, nv*dv]
        g, beta = gdn_gates(self.in_proj_a(hidden_states), self.in_proj_b(hidden_states),
                            self.A_log, self.dt_bias)                          # [N, nv] each

        weight = self.conv1d.weight[:, 0]                                      # [C, K]
        if decode:
            mixed = causal_conv1d_update(mixed, state.conv, weight)
        else:
            mixed, conv = causal_conv1d(mixed, weight, cu_seqlens, None if state is None else state.conv)
            if state is not None:
                state.conv.copy_(conv)

        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.view(num_tokens, nk, dk)) * dk ** -0.5                   # [N, nk, dk] fp32
        k = l2norm(k.view(num_tokens, nk, dk))
        q = q.repeat_interleave(nv // nk, dim=1)                               # [N, nv, dk]: v head j <- k head j // (nv/nk)
        k = k.repeat_interleave(nv // nk, dim=1)
        v = v.reshape(num_tokens, nv, dv)

        if decode:                                                             # one token per sequence: B = N, T = 1
            o, ssm = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                state.ssm)
            state.ssm.copy_(ssm)
            o = o[:, 0]                                                        # [N, nv, dv]
        else:
            o = torch.empty_like(v)
            bounds = cu_seqlens.tolist()
            for i in range(num_seqs):                                          # each sequence is a batch of 1
                s, e = bounds[i], bounds[i + 1]
                initial = None if state is None else state.ssm[i:i + 1]
                o_i, final = chunk_gated_delta_rule(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                                    beta[None, s:e], initial)
                o[s:e] = o_i[0]
                if state is not None:
                    state.ssm[i] = final[0]

        o = self.norm(o.reshape(-1, dv), z.reshape(-1, dv))                  # per value head: [N*nv, dv]
        return self.out_proj(o.reshape(num_tokens, self.value_dim))
