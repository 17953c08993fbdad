"""Every 易错点 of lessons/e06_serving.md, planted into a copy of the reference."""

from checks.plants import Plant

PLANTS = [
    Plant("decode_token_by_token", "逐个 token 单独解码再拼接",
          old="        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)\n",
          new="        text = self.text + self.tokenizer.decode([token_id], skip_special_tokens=True)\n",
          expect="逐个 token 单独解码"),
    Plant("no_stop_holdback", "流式输出先漏出了 stop 字符串的前半截",
          old="        self.hold = max((len(s) for s in stop), default=1) - 1",
          new="        self.hold = 0",
          expect="前半截"),
    Plant("no_abort_on_disconnect", "客户端断开（或提前结束）时没有 abort 引擎里的请求",
          old="        if not handle.finished:\n            self._send(\"abort\", handle)\n",
          new="",
          expect="没有 abort 引擎里的请求"),
    Plant("unary_disconnect_unnoticed", "非流式请求的客户端断开没有被发现",
          old="        return await _unless_disconnected(request, complete(engine, handle, req, model_name))\n",
          new="        return JSONResponse(await complete(engine, handle, req, model_name))\n",
          expect="非流式请求的客户端断开没有被发现"),
    Plant("rejected_request_counted", "被 503 拒绝的请求也占了名额",
          old="        if self.pending >= self.max_pending:\n"
              "            raise Overloaded(f\"{self.pending} requests in flight (the bound is {self.max_pending}); retry later\")\n"
              "        self.pending += 1\n",
          new="        self.pending += 1\n"
              "        if self.pending > self.max_pending:\n"
              "            raise Overloaded(f\"{self.pending} requests in flight (the bound is {self.max_pending}); retry later\")\n",
          expect="占了名额"),
    Plant("unknown_field_ignored", "未知字段被悄悄忽略",
          old="        if name not in fields:\n            raise RequestError(f\"unknown field {name!r}\", name)\n",
          new="        if name not in fields:\n            continue\n",
          expect="未知字段被悄悄忽略"),
    Plant("bool_is_a_number", "bool 被当成了数字",
          old="isinstance(value, kind) and not isinstance(value, bool)",
          new="isinstance(value, kind)",
          expect="bool 被当成了数字"),
]
