"""E05 · Engine loop: requests in, tokens out; step(), generate() with progress, streaming.

    LLM(model)                      an HF folder, an HF config (dummy weights) or an m06 model
      add_request(prompt, params)   validate -> Sequence -> scheduler.waiting  (bad input: ValueError, nothing queued)
      step()                        scheduler.schedule() -> runner.run() -> scheduler.postprocess()
      generate(prompts, params)     add everything, step until done; a bad request gets its error, the rest run
      stream(prompts, params)       the same loop, yielding every token as soon as it is sampled

Token ids in, token ids out; with a tokenizer, strings in and text out as well.
A hybrid (Gated DeltaNet) model with enable_prefix_caching=True gets e07's parts: HybridBlockManager,
HybridScheduler and a SnapshotRunner around the runner (GDN state snapshots at block boundaries).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .e01_sampling import SamplingParams
from .e02_block_manager import BlockManager, Sequence, SequenceStatus
from .e03_scheduler import Scheduler, SchedulerConfig
from .e04_model_runner import ModelRunner
from .e07_hybrid_prefix_cache import HybridBlockManager, HybridScheduler, SnapshotRunner, StateCache
from .m06_models import build_model, from_pretrained, init_dummy_weights


@dataclass
class EngineConfig:
    """Static engine settings, checked once."""
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    block_size: int = 16
    num_kvcache_blocks: int = 256
    enable_prefix_caching: bool | None = None     # None: on, except for hybrid (Gated DeltaNet) models
    num_state_snapshots: int = 64                 # hybrid prefix caching (e07): GDN state snapshots kept
    enable_chunked_prefill: bool = True
    dtype: torch.dtype = torch.float32
    seed: int = 0                                 # dummy weights only

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kvcache_blocks",
                     "num_state_snapshots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finished: bool = False
    error: str | None = None


class LLM:
    def __init__(self, model, tokenizer=None, **kwargs):
        self.config = config = EngineConfig(**kwargs)
        self.model, self.tokenizer = _load(model, tokenizer, config)
        hf_config = self.model.config
        self.vocab_size = hf_config.vocab_size
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else getattr(hf_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        hybrid = bool(self.model.linear_layer_ids)
        prefix = (not hybrid) if config.enable_prefix_caching is None else config.enable_prefix_caching
        snapshots = hybrid and prefix      # e07: a GDN layer resumes from a state snapshot, not from KV blocks
        state_cache = StateCache(self.model, config.num_state_snapshots, config.dtype) if snapshots else None
        self.block_manager = (HybridBlockManager(config.num_kvcache_blocks, config.block_size, state_cache) if snapshots
                              else BlockManager(config.num_kvcache_blocks, config.block_size, enable_prefix_caching=prefix))
        self.scheduler = (HybridScheduler if snapshots else Scheduler)(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, eos_token_id=-1 if eos is None else int(eos),
            enable_chunked_prefill=config.enable_chunked_prefill), self.block_manager)
        self.runner = ModelRunner(self.model, config.num_kvcache_blocks, config.block_size, config.max_num_seqs)
        if snapshots:
            self.runner = SnapshotRunner(self.runner, state_cache)
        self.requests: dict[int, Sequence] = {}

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None) -> int:
        """Queue one request and return its id; invalid input raises ValueError and queues nothing."""
        raise NotImplementedError("e05: 请实现 LLM.add_request（见 lessons/e05_engine.md）")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def abort(self, request_id: int) -> None:
        """Drop a request that has not finished: its blocks and GDN slot go back at once."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        for queue in (self.scheduler.waiting, self.scheduler.running):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        self.runner.release(seq)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[tuple[int, int, bool]]:
        """Run one scheduled batch; returns (request_id, new_token, finished) for every token sampled."""
        raise NotImplementedError("e05: 请实现 LLM.step（见 lessons/e05_engine.md）")

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(seq.seq_id, seq.prompt_token_ids, seq.completion_token_ids, text,
                             finished=seq.status == SequenceStatus.FINISHED)

    def _submit(self, prompts, sampling_params) -> list[int | RequestOutput]:
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        handles = []
        for prompt, params in zip(prompts, sampling_params):
            try:
                handles.append(self.add_request(prompt, params))
            except ValueError as exc:                 # this request only; the others are served
                handles.append(RequestOutput(-1, [], error=str(exc)))
        return handles

    def generate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in prompt order; an invalid request's output has `error` set and no tokens."""
        raise NotImplementedError("e05: 请实现 LLM.generate（见 lessons/e05_engine.md）")

    def stream(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[tuple[int, int | None, bool, str | None]]:
        """Yield (prompt index, token id, finished, error) as soon as each token is sampled."""
        raise NotImplementedError("e05: 请实现 LLM.stream（见 lessons/e05_engine.md）")

    @property
    def stats(self) -> dict[str, int]:
        stats = {"prefix_hit_blocks": self.block_manager.num_prefix_hits,
                 "preemptions": self.scheduler.num_preemptions, "steps": self.scheduler.num_steps,
                 "free_blocks": self.block_manager.num_free_blocks, "total_blocks": len(self.block_manager.blocks)}
        if isinstance(self.block_manager, HybridBlockManager):     # e07's snapshot counters
            stats.update(self.block_manager.state_cache.stats)
        return stats


def _load(model, tokenizer, config: EngineConfig) -> tuple[nn.Module, object]:
    """An m06 model from a folder (with its tokenizer when there is one), a config (dummy weights) or a model."""
    if isinstance(model, (str, Path)):
        model_obj = from_pretrained(model, config.dtype)
        if tokenizer is None and any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model)
        return model_obj, tokenizer
    if isinstance(model, nn.Module):
        return model.eval(), tokenizer
    built = init_dummy_weights(build_model(model), seed=config.seed).to(config.dtype).eval()
    return built, tokenizer
