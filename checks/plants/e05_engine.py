"""Every 易错点 of lessons/e05_engine.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("no_vocab_check", "不检查 token id 是否在词表内",
          old="        if bad:\n            raise ValueError(",
          new="        if False:\n            raise ValueError(",
          expect="词表内"),
    Plant("token_upper_bound_only", "只查了 token id 的上界，-1 被收下",
          old="not 0 <= t < self.vocab_size]",
          new="not t < self.vocab_size]",
          expect="词表内"),
    Plant("no_length_check", "不检查 prompt 长度是否超过 max_model_len",
          old="        if len(token_ids) >= self.config.max_model_len:\n",
          new="        if False:\n",
          expect="max_model_len"),
    Plant("one_bad_request_aborts_all", "一个坏请求让整批请求都失败",
          old="            except ValueError as exc:                 # this request only; the others are served\n"
              "                handles.append(RequestOutput(-1, [], error=str(exc)))\n",
          new="            except ValueError:\n                raise\n",
          expect="整批请求都失败"),
    Plant("gdn_slot_kept_on_preemption", "抢占后没有归还 GDN 状态槽位，重算时带着旧状态",
          old="            for seq in self.scheduler.waiting:\n                self.runner.release(seq)\n",
          new="            pass\n",
          expect="GDN 状态槽位"),
    Plant("stream_only_at_finish", "stream 攒到请求结束才一次性吐出",
          old="                    if seq_id in index:\n                        yield index[seq_id], token, finished, None\n",
          new="                    if seq_id in index and finished:\n                        yield index[seq_id], token, finished, None\n",
          expect="攒到请求结束"),
    Plant("stream_without_finally", "中途退出 stream 后请求没有 abort",
          old="""        try:
            while self.has_unfinished():
                for seq_id, token, finished in self.step():
                    if seq_id in index:
                        yield index[seq_id], token, finished, None
                        if finished:
                            self.requests.pop(seq_id, None)
        finally:                                      # the caller stopped reading: abort what is left
            for seq_id in index:
                self.abort(seq_id)
""",
          new="""        while self.has_unfinished():
            for seq_id, token, finished in self.step():
                if seq_id in index:
                    yield index[seq_id], token, finished, None
                    if finished:
                        self.requests.pop(seq_id, None)
""",
          expect="中途退出 stream 后请求没有 abort"),
    Plant("requests_never_popped", "generate 返回后没有把请求从 requests 里删掉",
          old="self._output(self.requests.pop(h))",
          new="self._output(self.requests[h])",
          expect="没有把请求从 self.requests 里删掉"),
    Plant("abort_keeps_gdn_slot", "abort 运行中的请求时没有 release",
          old="        seq.status = SequenceStatus.FINISHED\n        self.runner.release(seq)\n",
          new="        seq.status = SequenceStatus.FINISHED\n",
          expect="abort 运行中的请求时没有 runner.release"),
    Plant("finished_not_released", "结束的请求没有 runner.release",
          old="            if id(seq) in finished:\n                self.runner.release(seq)\n",
          new="",
          expect="结束的请求没有 runner.release"),
    Plant("prompt_length_off_by_one", "prompt 恰好 max_model_len 时被收下",
          old="        if len(token_ids) >= self.config.max_model_len:\n",
          new="        if len(token_ids) > self.config.max_model_len:\n",
          expect="len(prompt) >= max_model_len 就拒绝"),
    Plant("bool_token_id_accepted", "bool 的 token id 被当成 0 / 1 收下",
          old="bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)",
          new="bad = [t for t in token_ids if not isinstance(t, int)",
          expect="True 是 int 的子类"),
    Plant("no_per_sequence_block_size", "Sequence 没有设引擎的 block_size",
          old="        seq.block_size = self.config.block_size      # per sequence: several engines may live in one process\n",
          new="",
          expect="add_request 创建 Sequence 后要设 seq.block_size"),
    Plant("special_tokens_in_text", "解码时没有 skip_special_tokens",
          old="skip_special_tokens=True) if self.tokenizer else None",
          new="skip_special_tokens=False) if self.tokenizer else None",
          expect="没有 skip_special_tokens=True"),
    Plant("params_none_not_defaulted", "sampling_params 只接受了 SamplingParams（None 没有换成默认的 SamplingParams()）",
          old="        if sampling_params is None:\n            sampling_params = SamplingParams()\n",
          new="",
          expect="默认的 SamplingParams()"),
    Plant("params_dict_rejected", "sampling_params 只接受了 SamplingParams（合法的 dict 也被拒绝）",
          old="        if isinstance(sampling_params, dict):         # SamplingParams validates: a bad value is a ValueError\n"
              "            try:\n"
              "                sampling_params = SamplingParams(**sampling_params)\n"
              "            except TypeError as exc:                  # a misspelled field name\n"
              "                raise ValueError(f\"invalid sampling params: {exc}\") from exc\n",
          new="        if isinstance(sampling_params, dict):\n"
              "            raise ValueError(f\"sampling_params must be a SamplingParams, got {sampling_params!r}\")\n",
          expect="SamplingParams(**d)"),
    Plant("params_other_type_accepted", "sampling_params 的类型没有检查（0.5 进了调度器）",
          old="        if not isinstance(sampling_params, SamplingParams):\n"
              "            raise ValueError(f\"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}\")\n",
          new="",
          expect=None),
    Plant("requests_before_scheduler_add", "scheduler.add 抛错的请求留在了 requests 里（先登记再 add）",
          old="        self.scheduler.add(seq)                       # raises ValueError if the KV pool can never hold it\n"
              "        self.requests[seq.seq_id] = seq\n",
          new="        self.requests[seq.seq_id] = seq\n"
              "        self.scheduler.add(seq)\n",
          expect="scheduler.add 抛 ValueError"),
    Plant("tqdm_per_step", "进度条每步前进 1（而不是本步结束的请求数）",
          old="            if bar is not None and done:\n                bar.update(done)\n",
          new="            if bar is not None:\n                bar.update(1)\n",
          expect="进度条"),
]
