"""E01 · Sampling: SamplingParams with validation, and a batched sampler with per-request parameters and seeds.

Per row b of logits [B, V] in fp32 (exactly HF's warper chain, transformers.generation.logits_process):
    x = logits / temperature                                  TemperatureLogitsWarper
    top-k: drop x_j < (k-th largest x), ties kept; k=0 off    TopKLogitsWarper
    top-p: sort ascending, c = cumsum(softmax(sorted x));     TopPLogitsWarper
           drop c <= 1 - top_p, never the largest token      (= smallest set with mass >= top_p)
    min-p: p = softmax(x); drop p < min_p * max(p)            MinPLogitsWarper
    dropped entries become -inf

Sampling, the vLLM way (exponential race): temperature 0 -> argmax(logits). Otherwise
probs = softmax(x), q_j ~ Exp(1) drawn from the row's own generator, token = argmax(probs / q).
P(argmax_j p_j / q_j = i) = p_i, so this is an exact draw from probs; and since row b's noise comes only
from row b's generator, a seeded request gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5           # a positive temperature below this is greedy (logits / 1e-40 overflow fp32 to inf)
SEED_LIMIT = 2**64            # torch.Generator.manual_seed holds a seed in [0, 2**64)
TOP_K_LIMIT = 2**63           # top_k goes into an int64 tensor


@dataclass
class SamplingParams:
    """One request's sampling settings. __post_init__ rejects bad values with a ValueError naming the field."""
    temperature: float = 1.0      # 0 = greedy (argmax); must be >= 0; below GREEDY_BELOW stored as 0
    top_k: int = 0                # 0 = off; else in [1, TOP_K_LIMIT) (larger than V = off)
    top_p: float = 1.0            # (0, 1]; 1 = off
    min_p: float = 0.0            # [0, 1]; 0 = off
    seed: int | None = None       # [0, SEED_LIMIT); same seed -> same tokens whatever else is in the batch
    max_tokens: int = 64          # >= 1
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)    # given as any list; held as a set
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """Validate every field; raise ValueError("<field> must ..., got <value>") on the first bad one.

        Numbers must be real numbers (bool and str are rejected); ints are accepted for float fields and
        converted (an int too large for a float, such as 10**400, is a ValueError naming the field, not the
        OverflowError of float()). Every value must fit where the engine puts it (seed < SEED_LIMIT,
        top_k < TOP_K_LIMIT), so a bad request fails here, alone, and never inside a batched step. A valid top_k
        may be far larger than the vocabulary (= no cut): the Sampler holds it in int64, never int32. A
        temperature in (0, GREEDY_BELOW) is stored as 0.0 (greedy). stop_token_ids may be any list/tuple/set of
        non-negative ints and is stored as a frozenset: the engine asks `token in stop_token_ids` at every token,
        and a list of a million ids would be scanned each time.
        """
        raise NotImplementedError("e01: 请实现 SamplingParams.__post_init__ 的参数校验（见 lessons/e01_sampling.md）")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A request's own RNG, created once when the request arrives: None (use the global RNG) without a seed."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def warp_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32; temperature [B] (> 0), top_k [B] int (0 = off), top_p [B] (1 = off),
    min_p [B] (0 = off) -> [B, V]: logits / temperature with every filtered entry set to -inf.

    Row for row identical to HF's Temperature -> TopK -> TopP -> MinP warpers (min_tokens_to_keep=1);
    equal logits in index order (a stable ascending sort, as HF's sort gives them on rows of <= 16). One sort serves both top-k and top-p; no loop over rows.
    """
    raise NotImplementedError("e01: 请实现 warp_logits（见 lessons/e01_sampling.md）")


class Sampler:
    """One token per request from one step's logits: greedy rows take argmax, the others run an
    exponential race whose noise comes from the row's own generator."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [B, V] (any float dtype; computed in fp32), params and generators of length B -> ids [B] int64.

        temperature 0: argmax of the logits (first max on ties), no noise drawn. Otherwise: warp_logits,
        softmax in fp32, q[b] = torch.empty(V).exponential_(generator=generators[b]) (fp32, once per call;
        the global RNG when the generator is None), token = argmax(probs / q).
        """
        raise NotImplementedError("e01: 请实现 Sampler.__call__（见 lessons/e01_sampling.md）")
