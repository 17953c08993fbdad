"""The seed contract of lessons/e01_sampling.md, computed independently of the exercise, for the engine checks.

A seeded request's generator is made once when the request arrives and used for every token it samples:
its t-th sampled token is argmax(softmax(HF warpers(logits)) / q_t), where q_t is the t-th draw
torch.empty(V).exponential_(generator=g) of torch.Generator().manual_seed(seed). `ContractSampler` wraps the
runner's sampler, lets it answer, and checks every seeded row against that, whatever happened in between
(chunked prefill, preemption, other requests in the batch).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

FRESH = ("这个带 seed 的请求用的是一个新建的 generator（它的第 0 份噪声），而不是一直用下来的那个：generator 被重新建了"
         "（每一步重建，或抢占 / release 时丢掉后又按 seed 重建）。它应在请求第一次采样前建一次，跟着请求直到结束"
         "——被抢占的请求重算之后接着用同一个 generator")


def warped_probs(logits: torch.Tensor, sp) -> torch.Tensor:
    """softmax of HF's warper chain for one row [V] (the order GenerationMixin uses)."""
    procs = [TemperatureLogitsWarper(sp.temperature)]
    if sp.top_k:
        procs.append(TopKLogitsWarper(top_k=sp.top_k))
    if sp.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=sp.top_p))
    if sp.min_p:
        procs.append(MinPLogitsWarper(min_p=sp.min_p))
    return torch.softmax(LogitsProcessorList(procs)(None, logits.float()[None].clone()), -1)[0]


def contract_token(logits: torch.Tensor, sp, draw: int) -> int:
    """The token a seeded row gets at its draw-th sample (0-based) with these logits [V]."""
    gen = torch.Generator().manual_seed(sp.seed)
    for _ in range(draw + 1):
        q = torch.empty(logits.numel()).exponential_(generator=gen)
    return int((warped_probs(logits, sp) / q).argmax())


def _made_anew(samples: list) -> bool:
    """Do the tokens follow a generator made anew at one or more samples (each time drawing its noise from 0 again,
    as after a preemption that dropped it)? Tried over every set of restart points: a sample right after a restart
    may still match the unbroken contract by chance, so the first mismatch can come later than the restart."""
    states = {(0, False)}                                   # (draws taken from the current generator, restarted yet)
    for i, (x, sp, g) in enumerate(samples):
        nxt = {(k + 1, r) for k, r in states if g == contract_token(x, sp, k)}
        if i > 0 and g == contract_token(x, sp, 0):
            nxt.add((1, True))
        states = nxt
        if not states:
            return False
    return any(r for _, r in states)


class ContractSampler:
    """Stands in for runner.sampler: the wrapped sampler answers and every seeded sampling row is recorded;
    verify() checks them all against the contract (and names a re-created generator when the tokens show one)."""

    def __init__(self, sampler, what: str, rand=None):
        self.sampler, self.what, self.rand = sampler, what, rand
        self.samples: dict[int, list] = {}       # seed -> [(logits [V], params, token), ...] in sampling order

    def __call__(self, logits, params, generators):
        tokens = self.sampler(logits, params, generators)
        for row, sp in enumerate(params):
            if sp.seed is not None and sp.temperature > 0 and isinstance(tokens, torch.Tensor):
                self.samples.setdefault(sp.seed, []).append((logits[row].detach().float().clone(), sp,
                                                             int(tokens[row])))
        return tokens

    @property
    def checked(self) -> int:
        return sum(len(v) for v in self.samples.values())

    def verify(self) -> None:
        for seed, samples in self.samples.items():
            wants = [contract_token(x, sp, t) for t, (x, sp, _) in enumerate(samples)]
            bad = [t for t, ((_, _, got), want) in enumerate(zip(samples, wants)) if got != want]
            if not bad:
                continue
            s = bad[0]
            x, sp, got = samples[s]
            msg = (f"{self.what}：seed={seed} 的请求第 {s} 次采样（temperature={sp.temperature}, top_k={sp.top_k}）"
                   f"得到 token {got}，按 e01 的约定应为 {wants[s]}（make_generator(seed) 只建一次，第 t 次采样用它的"
                   f"第 t 份噪声）；这个请求的 {len(samples)} 次采样：得到 {[g for _, _, g in samples]}，"
                   f"约定 {wants}")
            rest = samples[s:]
            every_step = all(g == contract_token(x, sp, 0) for x, sp, g in rest)
            if s > 0 and len(rest) >= 2 and (every_step or _made_anew(samples)):
                msg += f"\n  看起来像易错点：{FRESH}"
            raise AssertionError(msg + (f"；{self.rand}" if self.rand is not None else ""))
