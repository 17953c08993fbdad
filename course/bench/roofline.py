"""The bytes a decode phase must move, and the time that takes at a measured bandwidth: the bench's upper bound.

Every decode step reads (memory-bound, so bytes / bandwidth is a lower bound on its time):
  K/V        every attention layer's keys and values of each running sequence's whole context
  weights    every parameter once, except the embedding table (only B rows are gathered; when it is tied to the
             LM head it is read in full as the head); MoE experts: only the ones some token is routed to, counted
             as the expected number of distinct experts under uniform routing, E * (1 - (1 - k/E)^B)
  GDN        each sequence's conv and recurrent states of every linear layer, read and written back
  logits     [B, V] written by the LM head and read by the sampler
The schedule is the bench's: every prompt is prefilled first, then decode step t (t = 1, 2, ...) runs every sequence
whose output length exceeds t, at context prompt + t. Prefill is compute-bound and is left out: the bench reports its
measured time beside the bound.
"""

from __future__ import annotations

import numpy as np


def engine_bytes(model, runner) -> dict:
    """Per-token, per-sequence and per-step byte counts of an engine (e04's runner or g01's): from its tensors."""
    kv = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in runner.kv_caches)            # one token, all layers
    pool = getattr(runner, "gdn_pool", None)
    gdn = 0 if pool is None else 2 * sum(pool.conv[i][0].nbytes + pool.ssm[i][0].nbytes for i in pool.conv)
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    dense = experts = 0
    for name, p in model.named_parameters():
        if p is embed and not tied:
            continue
        if ".experts." in name:
            experts += p.nbytes
        else:
            dense += p.nbytes
    cfg = model.config
    return dict(kv_per_token=kv, gdn_per_seq=gdn, dense_weights=dense, expert_weights=experts,
                num_experts=getattr(cfg, "num_experts", 0) or 0, top_k=getattr(cfg, "num_experts_per_tok", 0) or 0,
                logits_per_seq=2 * cfg.vocab_size * embed.element_size())


def step_bytes_by_reader(sizes: dict, batch: int, context_tokens: int) -> dict:
    """step_bytes with the weights split by the kernels that read them (the profile's floors, course/bench/profile.py):
    dense (every non-expert parameter: the GEMMs) and experts (the MoE kernels)."""
    E, k = sizes["num_experts"], sizes["top_k"]
    hit = 1 - (1 - k / E) ** batch if E else 0.0                  # expected share of the experts read
    return dict(kv=float(context_tokens) * sizes["kv_per_token"], dense=float(sizes["dense_weights"]),
                experts=hit * sizes["expert_weights"], gdn=batch * sizes["gdn_per_seq"],
                logits=batch * sizes["logits_per_seq"])


def step_bytes(sizes: dict, batch: int, context_tokens: int) -> dict:
    """Bytes by kind of one decode step of `batch` sequences whose contexts add up to `context_tokens`."""
    b = step_bytes_by_reader(sizes, batch, context_tokens)
    return dict(kv=b["kv"], weights=b["dense"] + b["experts"], gdn=b["gdn"], logits=b["logits"])


def decode_steps(sizes: dict, prompt_lens: list[int], out_lens: list[int]) -> list[tuple[int, dict]]:
    """(sequences decoded, bytes by kind) of every decode step of the bench's schedule, in order."""
    lens, outs = np.asarray(prompt_lens, np.int64), np.asarray(out_lens, np.int64)
    found = []
    for t in range(1, int(outs.max())):
        live = outs > t
        b = int(live.sum())
        found.append((b, step_bytes(sizes, b, int((lens[live] + t).sum()))))
    return found


def decode_bound(sizes: dict, prompt_lens: list[int], out_lens: list[int], gb_per_s: float) -> dict:
    """Bytes by kind over the bench's decode steps and the seconds they take at gb_per_s (1e9 bytes per second)."""
    total = dict(kv=0.0, weights=0.0, gdn=0.0, logits=0.0)
    steps = decode_steps(sizes, prompt_lens, out_lens)
    for _, nbytes in steps:
        for kind, value in nbytes.items():
            total[kind] += value
    seconds = sum(total.values()) / (gb_per_s * 1e9)
    return dict(bytes=total, steps=len(steps), seconds=seconds, gb_per_s=gb_per_s)
