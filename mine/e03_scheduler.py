"""E03 · Scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute.

One step is ONE unified batch (vLLM v1 style). A scheduled sequence computes the tokens
[num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of its token list:

    decode          num_scheduled_tokens = 1                           (the token sampled last step)
    prefill chunk   1 <= num_scheduled_tokens <= num_tokens - num_cached_tokens   (only the uncached rest)

    sum(num_scheduled_tokens) <= max_num_batched_tokens          len(running) <= max_num_seqs

Order inside one step (first come, first served; nothing starves):
    1. running decodes, oldest first. The token appended last step needs a KV slot; when it starts a
       new block and none is free, the NEWEST running request is preempted (recompute: its blocks are
       freed, num_cached_tokens = 0, it goes back to the FRONT of waiting) until one is free; if the
       one in need is itself the newest, it yields.
    2. running prefills that are not done yet (chunked prefill): the next chunk starts where the last ended.
    3. waiting requests in order: allocate blocks for all their tokens (prefix-cache hits make
       num_cached_tokens > 0, and only the rest counts against the budget; at least the last token is
       always computed so that its logits exist). Without chunked prefill a prompt that does not fit the
       budget left waits for a later step. No admission in a step that preempted (as in vLLM: the
       request just evicted would take its blocks straight back).

postprocess, after the model step: num_cached_tokens += num_scheduled_tokens; only a sequence whose
tokens are now ALL computed samples (appends) a token; a partial prefill chunk samples nothing. Then it
finishes on eos (unless ignore_eos), a stop token, max_tokens completion tokens or max_model_len.

Lesson: lessons/e03_scheduler.md (#10, book §E.3).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .e02_block_manager import BlockManager, Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Static limits of the scheduler, checked once."""
    max_num_seqs: int = 256               # most requests running at once (so also the largest batch)
    max_num_batched_tokens: int = 8192    # token budget of one step: decodes and prefill chunks together
    max_model_len: int = 4096             # prompt + completion never grows past this
    eos_token_id: int = -1                # -1: no eos (token ids are >= 0)
    enable_chunked_prefill: bool = True   # False: a prompt is prefilled in one step, or waits

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.eos_token_id, bool) or not isinstance(self.eos_token_id, int):
            raise ValueError(f"eos_token_id must be an int (-1 for none), got {self.eos_token_id!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running decode needs one token of the budget")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                             f"be >= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled")


class Scheduler:
    """Decides, every step, which requests run and how many of their tokens are computed."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()   # FIFO; a preempted request goes back to the front
        self.running: deque[Sequence] = deque()   # admission order: running[0] oldest, running[-1] newest
        self.num_preemptions = 0
        self.num_steps = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Enqueue a new request (status WAITING) at the back of `waiting`.

        Raises ValueError when the whole KV pool could never hold the request at its longest,
        min(num_prompt_tokens + max_tokens, max_model_len) tokens: it would wait (or preempt itself) forever.
        """
        raise NotImplementedError("e03: 请实现 Scheduler.add（见 lessons/e03_scheduler.md）")

    def schedule(self) -> list[Sequence]:
        """Build this step's batch: decodes, then running prefill chunks, then new admissions.

        Sets num_scheduled_tokens (>= 1) on every returned sequence; the batch holds at most
        max_num_seqs sequences and at most max_num_batched_tokens tokens in all.
        """
        raise NotImplementedError("e03: 请实现 Scheduler.schedule（见 lessons/e03_scheduler.md）")

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free all of seq's blocks and send it back to the FRONT of `waiting`.

        Its tokens (prompt + what it generated) are kept; on re-admission they are prefilled again.
        """
        raise NotImplementedError("e03: 请实现 Scheduler.preempt（见 lessons/e03_scheduler.md）")

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """After the model step: seqs is the batch from schedule(), token_ids[i] the token sampled for seqs[i].

        Advances num_cached_tokens; appends token_ids[i] only when all of seqs[i]'s tokens are now
        computed; finishes (status FINISHED, blocks freed, removed from running) on eos / stop token /
        max_tokens / max_model_len. Returns the sequences that finished in this step.
        """
        raise NotImplementedError("e03: 请实现 Scheduler.postprocess（见 lessons/e03_scheduler.md）")
