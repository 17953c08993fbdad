"""Every 易错点 of lessons/e03_scheduler.md, planted into a copy of the reference."""

from checks.plants import Plant

_DECODES = (
    '        # 1) decodes, oldest first: one token each, and a KV slot for the token appended last step\n'
    '        for seq in list(self.running):\n'
    '            if seq.status != SequenceStatus.RUNNING or seq.num_tokens - seq.num_cached_tokens != 1:\n'
    '                continue                                    # preempted just now, or a prefill in progress\n'
    '            while not block_manager.can_append(seq):        # its new token opens a block and none is free\n'
    '                victim = self.running[-1]                   # the newest running request yields\n'
    '                self.preempt(victim)\n'
    '                if victim is seq:\n'
    '                    break\n'
    '            if seq.status != SequenceStatus.RUNNING:\n'
    '                continue                                    # it was the newest: it yielded itself\n'
    '            block_manager.may_append(seq)\n'
    '            seq.num_scheduled_tokens = 1\n'
    '            batch.append(seq)\n'
    '            budget -= 1\n'
    '\n'
)

_PREFILLS = (
    '        # 2) running prefills that are not done yet: the next chunk continues where the last ended\n'
    '        for seq in self.running:\n'
    '            remaining = seq.num_tokens - seq.num_cached_tokens\n'
    '            if remaining > 1 and budget > 0:\n'
    '                seq.num_scheduled_tokens = min(remaining, budget)\n'
    '                batch.append(seq)\n'
    '                budget -= seq.num_scheduled_tokens\n'
    '\n'
)

_ADMISSIONS = (
    '        # 3) admit waiting requests in order; the head never gets overtaken\n'
    '        while (self.waiting and budget > 0 and len(self.running) < config.max_num_seqs\n'
    '               and self.num_preemptions == preemptions_before):\n'
    '            seq = self.waiting[0]\n'
    '            if not config.enable_chunked_prefill and seq.num_tokens > budget:\n'
    '                break                                       # not chunked: the whole prompt fits, or it waits\n'
    '            if not block_manager.can_allocate(seq):\n'
    '                break                                       # waits for blocks\n'
    '            block_manager.allocate(seq)                     # num_cached_tokens = prefix-cache hits (never all)\n'
    '            remaining = seq.num_tokens - seq.num_cached_tokens          # only the uncached tokens cost budget\n'
    '            seq.num_scheduled_tokens = min(remaining, budget)\n'
    '            seq.status = SequenceStatus.RUNNING\n'
    '            self.running.append(self.waiting.popleft())\n'
    '            batch.append(seq)\n'
    '            budget -= seq.num_scheduled_tokens\n'
    '\n'
)

# admissions first; the decode loop then gets what they left of the budget (skipping the newly admitted)
_DECODES_LAST = _DECODES.replace(
    "        for seq in list(self.running):\n",
    "        for seq in list(self.running):\n            if budget == 0:\n                break\n").replace(
    "if seq.status != SequenceStatus.RUNNING or", "if seq in batch or seq.status != SequenceStatus.RUNNING or")
_PREFILLS_LAST = _PREFILLS.replace("if remaining > 1 and budget > 0:", "if remaining > 1 and budget > 0 and seq not in batch:")

PLANTS = [
    Plant("whole_prompt_against_budget", "把整段 prompt（而不是未命中 prefix cache 的部分）计入预算",
          old="            remaining = seq.num_tokens - seq.num_cached_tokens          # only the uncached tokens cost budget\n",
          new="            remaining = seq.num_tokens\n",
          expect="把整段 prompt"),
    Plant("sample_after_partial_chunk", "部分 prefill 块之后也采样 token",
          old="            if seq.num_cached_tokens < seq.num_tokens:\n"
              "                continue                                    # a partial prefill chunk: no next token yet\n",
          new="",
          expect="部分 prefill 块之后采样了 token"),
    Plant("preempt_oldest", "抢占最老的请求而不是最新的",
          old="                victim = self.running[-1]                   # the newest running request yields\n",
          new="                victim = self.running[0]\n",
          expect="抢占了最老的请求"),
    Plant("preempt_without_freeing", "抢占时忘了释放块 / 把 num_cached_tokens 清零",
          old="        self.block_manager.deallocate(seq)\n        seq.num_cached_tokens = 0\n",
          new="",
          expect="抢占时忘了释放块"),
    Plant("preempt_to_back", "被抢占的请求放回 waiting 队尾",
          old="        self.waiting.appendleft(seq)\n", new="        self.waiting.append(seq)\n",
          expect="放回 waiting 队首"),
    Plant("prefill_before_decodes", "先接纳 prefill 再排 running 的 decode",
          old=_DECODES + _PREFILLS + _ADMISSIONS,
          new=_ADMISSIONS + _DECODES_LAST + _PREFILLS_LAST,
          expect="先接纳 prefill 再排 decode"),
    Plant("no_max_num_seqs", "接纳新请求时不看 max_num_seqs",
          old="        while (self.waiting and budget > 0 and len(self.running) < config.max_num_seqs\n",
          new="        while (self.waiting and budget > 0\n",
          expect="max_num_seqs"),
    Plant("max_tokens_off_by_one", "max_tokens 差一（> 而不是 >=）",
          old="seq.num_completion_tokens >= params.max_tokens", new="seq.num_completion_tokens > params.max_tokens",
          expect="max_tokens 差一"),
    Plant("decode_without_slot", "decode 的新 token 进入新块时没有 can_append / may_append",
          old="            while not block_manager.can_append(seq):        # its new token opens a block and none is free\n"
              "                victim = self.running[-1]                   # the newest running request yields\n"
              "                self.preempt(victim)\n"
              "                if victim is seq:\n"
              "                    break\n"
              "            if seq.status != SequenceStatus.RUNNING:\n"
              "                continue                                    # it was the newest: it yielded itself\n"
              "            block_manager.may_append(seq)\n",
          new="",
          expect="can_append"),
    Plant("cached_tokens_not_advanced", "postprocess 没有推进 num_cached_tokens",
          old="            seq.num_cached_tokens += seq.num_scheduled_tokens\n", new="",
          expect="没有把 num_cached_tokens 推进"),
    Plant("chunks_when_chunking_off", "关闭 chunked prefill 时仍然切块",
          old="            if not config.enable_chunked_prefill and seq.num_tokens > budget:\n"
              "                break                                       # not chunked: the whole prompt fits, or it waits\n",
          new="",
          expect="关闭 chunked prefill 时仍按剩余预算切块"),
    Plant("prompt_only_when_chunking_off", "关闭 chunked prefill 时拿 prompt 长度判断放不放得下",
          old="            if not config.enable_chunked_prefill and seq.num_tokens > budget:\n",
          new="            if not config.enable_chunked_prefill and seq.num_prompt_tokens > budget:\n",
          expect="预算按 prompt 长度"),
    Plant("finished_not_freed", "请求结束时忘了释放块",
          old="                seq.status = SequenceStatus.FINISHED\n                self.block_manager.deallocate(seq)\n",
          new="                seq.status = SequenceStatus.FINISHED\n",
          expect="没有释放块"),
    Plant("reject_by_prompt_only", "add 只按 prompt 判断 KV 池放不放得下",
          old="        longest = max(seq.num_tokens, min(seq.num_prompt_tokens + params.max_tokens, self.config.max_model_len))\n",
          new="        longest = seq.num_tokens\n",
          expect="add 只看了 prompt"),
    Plant("decode_not_charged", "decode 没有从预算里扣掉",
          old="            batch.append(seq)\n            budget -= 1\n",
          new="            batch.append(seq)\n",
          expect="decode 没有从预算里扣掉"),
    Plant("add_blocks_floor", "add 的块数向下取整",
          old="        needed = (longest + block_size - 1) // block_size\n",
          new="        needed = longest // block_size\n",
          expect="没有向上取整"),
    Plant("decode_loop_breaks_at_prefill", "以为没算完的 prefill 总在最后（遇到它就 break）",
          old="                continue                                    # preempted just now, or a prefill in progress\n",
          new="                break\n",
          expect="以为没算完的 prefill 总在最后"),
    Plant("postprocess_breaks_at_partial", "以为没算完的 prefill 总在最后（遇到它就 break）",
          old="                continue                                    # a partial prefill chunk: no next token yet\n",
          new="                break\n",
          expect="以为没算完的 prefill 总在最后"),
    Plant("yield_keeps_preempting", "需要块的序列让出自己之后没有停下",
          old="                if victim is seq:\n                    break\n",
          new="",
          expect="让出）之后没有停下"),
    Plant("preempt_only_once", "只抢占一次就 may_append",
          old="            while not block_manager.can_append(seq):        # its new token opens a block and none is free\n",
          new="            if not block_manager.can_append(seq):\n",
          expect="只抢占一次就 may_append"),
    Plant("admit_in_preemption_step", "发生抢占的那一步还接纳新请求",
          old="               and self.num_preemptions == preemptions_before):\n",
          new="               ):\n",
          expect="发生抢占的那一步还接纳了请求"),
]
