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
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
            try:
                setattr(self, name, float(value))
            except OverflowError:                     # an int beyond float's range (JSON ints have no size limit)
                raise ValueError(f"{name} must be a finite number, got an int too large for a float") from None
        for name in ("top_k", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:          # 1e-40 is a subnormal fp32, not 0: logits / T = inf, probs NaN
            self.temperature = 0.0
        if not 0 <= self.top_k < TOP_K_LIMIT:
            raise ValueError(f"top_k must be 0 (off) or in [1, 2**63), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:                   # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {token!r} in {self.stop_token_ids!r}")
        self.stop_token_ids = frozenset(self.stop_token_ids)


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
    vocab = logits.shape[-1]
    x = logits / temperature[:, None]                                   # [B, V]: temperature first
    sorted_x, order = torch.sort(x, dim=-1, stable=True)                # [B, V] ascending

    # top-k: the k-th largest is sorted_x[:, V - k]; anything strictly smaller goes (ties survive)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)           # [B], 0 = off = keep all V
    kth = sorted_x.gather(-1, (vocab - k)[:, None].long())              # [B, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)

    # top-p on what top-k left: drop the low tail whose total mass is <= 1 - top_p
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)                       # [B, V], last entry ~ 1
    drop = (cum <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]         # top_p = 1: the warper is off
    drop[:, -1] = False                                                 # the most likely token always stays
    sorted_x = sorted_x.masked_fill(drop, -math.inf)
    x = torch.empty_like(sorted_x).scatter_(-1, order, sorted_x)        # back to vocab order [B, V]

    # min-p: relative to the most likely survivor, not an absolute probability
    probs = x.softmax(dim=-1)                                           # [B, V]
    return x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), -math.inf)


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
        logits = logits.float()                                             # [B, V]: all math in fp32
        vocab, device = logits.shape[-1], logits.device
        greedy = [p.temperature == 0 for p in params]
        tokens = logits.argmax(dim=-1)                                      # [B] int64, the greedy answer
        if all(greedy):
            return tokens

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)        # [B]

        temperature = column([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32)
        # top_k in int64: a valid top_k may be 2**40 (larger than V = no cut); int32 overflows or wraps it
        x = warp_logits(logits, temperature, column([p.top_k for p in params], torch.int64),
                        column([p.top_p for p in params], torch.float32),
                        column([p.min_p for p in params], torch.float32))
        probs = torch.softmax(x, dim=-1)                                    # [B, V] fp32

        q = torch.empty_like(probs)                                         # [B, V] Exp(1) noise
        if any(g is None and not is_greedy for g, is_greedy in zip(generators, greedy)):
            q.exponential_()                                                # unseeded rows: the global RNG
        for row, (gen, is_greedy) in enumerate(zip(generators, greedy)):
            if gen is not None and not is_greedy:                           # seeded rows: their own stream only
                q[row] = torch.empty(vocab, device=gen.device).exponential_(generator=gen)
        sampled = (probs / q).argmax(dim=-1)                                # [B]

        is_greedy_row = column(greedy, torch.bool)
        return torch.where(is_greedy_row, tokens, sampled)
