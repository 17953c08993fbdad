"""Every 易错点 of lessons/e05_engine.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("no_vocab_check", "不检查 token id 是否在词表内",
          old="        if bad:\n            raise ValueError(",
          new="        if False:\n            raise ValueError(",
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
]
