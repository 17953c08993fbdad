"""Figures of Track E and the opening chapter: a request's life, paged KV, scheduler, batching timeline, the sampling
filters, one step's packed batch, the engine step, a streaming request through the server, the wait rule of the hybrid
prefix cache."""

from __future__ import annotations

from .svg import COLORS as C, Svg


def request_life() -> Svg:
    steps = [("tokenize", "chat template\n→ token ids", "e05"), ("schedule", "选进本步 batch\n分配 KV block", "e03 · e02"),
             ("prepare batch", "input_ids, positions\nslot_mapping, cu_seqlens", "e04"),
             ("forward", "Qwen3 / MoE / 3.5\n→ logits [B, V]", "m01–m07\nk01–k04 · g01"),
             ("sample", "temperature / top-k\ntop-p / min-p", "e01"),
             ("postprocess", "追加 token、判停\n释放 block", "e03 · e05"),
             ("stream", "增量 detokenize\n→ 用户（HTTP）", "e05 · e06")]
    chapters = ["track-e/e05-engine.md", "track-e/e03-scheduler.md", "track-e/e04-model-runner.md", "track-m/index.md",
                "track-e/e01-sampling.md", "track-e/e05-engine.md", "track-e/e06-serving.md"]
    s = Svg(760, 300, "一个请求的一生：从 prompt 到流式输出")
    w, gap, y = 96, 12, 70
    for i, (name, what, ex) in enumerate(steps):
        x = 14 + i * (w + gap)
        s.box(x, y, w, 40, name, fill=C["gpu"] if name == "forward" else C["kv"], weight="bold", size=12,
              href=chapters[i])
        s.text(x + w / 2, y + 62, what, size=10.5, color="#333")
        s.text(x + w / 2, y + 110, ex, size=11, weight="bold", color="#a33")
        if i:
            s.arrow(x - gap, y + 20, x - 1, y + 20)
    s.text(380, 34, "引擎的每一步（step）对 batch 里所有请求各走一遍中间五格；prefill 后每步只多一个 token", size=12)
    # loop back arrow from postprocess to schedule
    x_post = 14 + 5 * (w + gap) + w / 2
    x_sched = 14 + 1 * (w + gap) + w / 2
    s.line([(x_post, y + 130), (x_post, y + 160), (x_sched, y + 160), (x_sched, y + 122)])
    s.text((x_post + x_sched) / 2, y + 178, "未结束：下一步再调度（decode 一次一个 token）", size=11, color="#444")
    s.text(380, 286, "红字：实现这一格的练习；点一格打开讲它的一章", size=11, color="#a33")
    return s


def paged_kv() -> Svg:
    s = Svg(760, 400, "Paged KV cache：block table 与 prefix cache 的 hash 链")
    s.text(190, 24, "每个序列的 block table（block_size = 4）", size=13, weight="bold")
    seqs = [("seq A", "The cat sat on the mat .", [7, 2, 9]), ("seq B", "The cat sat on a rug", [7, 5])]
    for r, (name, _, table) in enumerate(seqs):
        y = 50 + r * 70
        s.text(40, y + 22, name, size=12, weight="bold")
        for j, blk in enumerate(table):
            s.box(80 + j * 70, y, 60, 34, f"#{blk}", fill=C["kv"], mono=True, size=12)
            s.text(110 + j * 70, y + 50, f"logical {j}", size=10, color="#555")
    s.text(190, 196, "block table[i] = 物理 block 号；slot = table[pos // bs]·bs + pos % bs", size=11)
    # physical pool
    s.text(560, 24, "KV cache 物理池（GPU 显存）", size=13, weight="bold")
    ref = {7: 2, 2: 1, 9: 1, 5: 1}
    for i in range(10):
        x, y = 410 + (i % 5) * 62, 44 + (i // 5) * 70
        used = i in ref
        s.box(x, y, 54, 40, f"#{i}", fill=C["kv"] if used else C["free"], mono=True, size=12, dash=not used)
        if used:
            s.text(x + 27, y + 56, f"ref={ref[i]}", size=10, color="#a33" if ref[i] > 1 else "#555")
    s.text(560, 196, "block #7 被 A、B 共享（ref=2）：共同前缀只存一份", size=11, color="#a33")
    s.curve(110, 50, 300, 0, 410 + 2 * 62 + 27, 44 + 70 + 2, dash=True)
    # hash chain
    s.text(380, 236, "prefix cache：只有写满的 block 才有 hash，hash 链住前面所有 token", size=13, weight="bold")
    xs = [40, 270, 500]
    labels = [("tokens 0–3", "h₀ = hash(∅, t₀..t₃)"), ("tokens 4–7", "h₁ = hash(h₀, t₄..t₇)"),
              ("tokens 8–9（未满）", "无 hash，不可共享")]
    for i, (tok, h) in enumerate(labels):
        s.box(xs[i], 256, 200, 34, tok, fill=C["kv"] if i < 2 else C["free"], size=12, dash=i == 2)
        s.box(xs[i], 304, 200, 34, h, fill=C["hot"] if i < 2 else C["free"], size=12, mono=True, dash=i == 2)
        s.arrow(xs[i] + 100, 290, xs[i] + 100, 302)
        if i:
            s.arrow(xs[i - 1] + 200, 321, xs[i] - 2, 321)
    s.text(380, 370, "新请求按 block 逐个查 hash → 物理 block；第一个查不到的 block 起重新计算（命中部分跳过 prefill）", size=11)
    s.text(380, 390, "同样的 4 个 token 出现在不同位置时 hash 不同：hash 链保证“前缀相同”而不只是“这一块相同”", size=11, color="#444")
    return s


def scheduler_states() -> Svg:
    s = Svg(720, 250, "Scheduler 的状态机")
    s.box(40, 90, 130, 56, "WAITING\n（waiting 队列）", fill=C["io"], weight="bold", size=12)
    s.box(300, 90, 130, 56, "RUNNING\n（running 队列）", fill=C["kv"], weight="bold", size=12)
    s.box(560, 90, 130, 56, "FINISHED", fill=C["mlp"], weight="bold", size=12)
    s.curve(170, 100, 235, 40, 298, 100)
    s.text(235, 52, "schedule：block 够 → allocate、prefill", size=11)
    s.curve(298, 138, 235, 200, 172, 138)
    s.text(235, 206, "preempt：block 不够 → deallocate，", size=11)
    s.text(235, 222, "放回 waiting 队首，之后重算（recompute）", size=11)
    s.arrow(430, 118, 558, 118)
    s.text(494, 108, "EOS / max_tokens", size=11)
    s.text(494, 140, "/ stop → 释放 block", size=11)
    s.curve(330, 90, 365, 20, 400, 90)
    s.text(365, 22, "每步 decode 一个 token（可能 append 一个 block）", size=11)
    s.text(360, 244, "chunked prefill：长 prompt 分几步 prefill，每步不超过 max_num_batched_tokens", size=11, color="#444")
    return s


def batching_timeline() -> Svg:
    s = Svg(760, 280, "Continuous batching 的时间线")
    steps = 10
    x0, cw, y0, rh = 110, 60, 50, 40
    s.text(x0 + steps * cw / 2, 24, "每列是引擎的一步（一次 forward）", size=12, weight="bold")
    for t in range(steps):
        s.text(x0 + t * cw + cw / 2, y0 - 8, f"step {t}", size=10, color="#555")
    reqs = [("req 0", [(0, 1, "P"), (1, 6, "D")], 6), ("req 1", [(0, 1, "P"), (1, 3, "D")], 3),
            ("req 2", [(3, 5, "P½"), (5, 10, "D")], None), ("req 3", [(6, 7, "P"), (7, 10, "D")], None)]
    for r, (name, spans, end) in enumerate(reqs):
        y = y0 + r * rh
        s.text(x0 - 14, y + 24, name, size=12, anchor="end", weight="bold")
        for a, b, kind in spans:
            for t in range(a, b):
                fill = C["hot"] if kind.startswith("P") else C["kv"]
                label = kind if kind.startswith("P") else "d"
                s.box(x0 + t * cw + 3, y + 4, cw - 6, rh - 10, label, fill=fill, size=11)
        if end:
            s.text(x0 + end * cw + 8, y + 24, "✓ 结束，block 释放", size=10, anchor="start", color="#2a7")
    s.text(x0 + 3 * cw, y0 + 4 * rh + 24, "P = prefill（整段 prompt），P½ = chunked prefill 的一块，d = decode 一个 token",
           size=11)
    s.text(x0 + 3 * cw, y0 + 4 * rh + 44, "req 1 在 step 3 结束，空出的位置当步就给了新来的 req 2——不用等整个 batch 跑完",
           size=11, color="#444")
    return s


def tp_engine() -> Svg:
    s = Svg(760, 390, "张量并行引擎：每个 rank 一个进程")
    for x, title, fill in ((14, "rank 0：调用者的进程 · cuda:0", C["cpu"]), (446, "rank 1：worker 进程 · cuda:1", C["cpu"])):
        s.rect(x, 30, 300, 262, fill=fill, dash=False)
        s.text(x + 150, 50, title, size=13, weight="bold")
    left = [("LLM.step：scheduler + block manager\n（只有 rank 0 调度）", C["kv"]),
            ("Rank0Runner.run：encode_step\n→ 每个 worker 的管道", C["hot"]),
            ("runner（分片 0）：前向\nKV cache、GDN 状态池、CUDA graphs", C["gpu"]),
            ("LM head all-gather → 采样\n只有 rank 0 的 token 算数", C["free"])]
    right = [("等下一步：管道 recv_bytes\n（EOF = rank 0 不在了）", C["free"]),
             ("decode_step → ShadowSequence\n只带本步要算的 token", C["hot"]),
             ("runner（分片 1）：同一步前向\n同样的代码、自己的 KV / 状态 / graphs", C["gpu"]),
             ("LM head all-gather（集合通信）\n采样器是占位，不采样", C["free"])]
    for i, ((a, fa), (b, fb)) in enumerate(zip(left, right)):
        y = 64 + i * 56
        s.box(28, y, 272, 44, a, fill=fa, size=11)
        s.box(460, y, 272, 44, b, fill=fb, size=11)
        if i:
            s.arrow(164, y - 12, 164, y - 1)
            s.arrow(596, y - 12, 596, y - 1)
    s.arrow(300, 142, 458, 90)
    s.text(372, 84, "每步一个 int64 数组", size=10.5, color="#a33")
    s.text(372, 98, "（不 pickle）", size=10.5, color="#a33")
    s.line([(300, 198), (458, 198)], arrow=True)
    s.line([(458, 206), (300, 206)], arrow=True)
    s.text(380, 190, "NCCL / gloo：每层 2 次", size=10.5, color="#a33")
    s.text(380, 224, "all-reduce [N, H]", size=10.5, color="#a33")
    s.line([(300, 254), (458, 254)], arrow=False, dash=True)
    s.text(380, 248, "all-gather [N, V/tp]", size=10.5, color="#a33")
    s.box(14, 306, 732, 70, "关闭：close() / with / 退出时 atexit → 每个 worker 收到 STOP；rank 0 被杀 → worker 的管道 EOF，"
          "PR_SET_PDEATHSIG 兜底\nworker 抛异常 → 把 traceback 发回 rank 0 再退出；rank 0 的 watchdog 线程发现任何 worker 退出 →"
          " 杀掉其余 worker，\n报出 “worker rank k died (exit code …)”；rank 0 卡在集合通信里超过 10 秒 → 打印后结束进程",
          fill=C["io"], size=10.5)
    return s


FIGURES = {"tp-engine": tp_engine, "request-life": request_life, "paged-kv": paged_kv, "scheduler-states": scheduler_states,
           "batching-timeline": batching_timeline}


def _softmax(xs: list[float | None]) -> list[float]:
    """softmax over the kept entries (None: cut, probability 0)."""
    import math
    top = max(x for x in xs if x is not None)
    e = [math.exp(x - top) if x is not None else 0.0 for x in xs]
    return [v / sum(e) for v in e]


def sampling_filters() -> Svg:
    """E.1: one row of logits through temperature, top-k, top-p and min-p (HF's order), numbers computed here."""
    z, t, k, top_p, min_p = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0], 0.8, 4, 0.8, 0.3
    x = [v / t for v in z]
    stages = [(f"temperature T = {t}", "p = softmax(z / T)", list(x))]
    kth = sorted(x, reverse=True)[k - 1]
    stages.append((f"top-k，k = {k}", "删掉 < 第 k 大的", [v if v >= kth else None for v in x]))
    p, kept, acc = _softmax(stages[-1][2]), list(stages[-1][2]), 0.0
    for i in sorted((i for i, v in enumerate(kept) if v is not None), key=lambda i: p[i])[:-1]:
        acc += p[i]                                  # ascending cumsum: drop while it stays <= 1 - top_p
        if acc <= 1 - top_p:
            kept[i] = None
    stages.append((f"top-p，top_p = {top_p}", "升序累加 ≤ 1 − top_p 的删掉", kept))
    p = _softmax(kept)
    stages.append((f"min-p，min_p = {min_p}", "删掉 p < min_p · p_max", [v if v is not None and p[i] >= min_p * max(p) else None
                                                                        for i, v in enumerate(kept)]))
    s = Svg(760, 330, "一行 logits 依次过 temperature、top-k、top-p、min-p")
    s.text(380, 22, f"一行 logits z = {z}（6 个 token）；每一格是这一步之后的概率，灰色虚框是被删掉的 token（logit = −inf）",
           size=11.5)
    pw, x0, base, hmax = 178, 20, 232, 150
    for n, (title, rule, xs) in enumerate(stages):
        px = x0 + n * (pw + 8)
        s.rect(px, 36, pw, 250, fill=C["io"] if n == 0 else C["free"])
        s.text(px + pw / 2, 56, title, size=12, weight="bold")
        s.text(px + pw / 2, 74, rule, size=10.5, color="#444")
        probs = _softmax(xs)
        for j, (v, pj) in enumerate(zip(xs, probs)):
            bx = px + 12 + j * 27
            if v is None:
                s.rect(bx, base - 6, 20, 6, fill="#fff", stroke="#999", rx=1, dash=True)
            else:
                h = max(2.0, hmax * pj)
                s.rect(bx, base - h, 20, h, fill=C["hot"] if pj == max(probs) else C["kv"], rx=1)
                s.text(bx + 10, base - h - 4, f"{pj:.2f}".lstrip("0"), size=9.5)
            s.text(bx + 10, base + 14, f"t{j}", size=9.5, color="#555", mono=True)
        if n:
            s.arrow(px - 8, 160, px - 1, 160)
    s.text(380, 306, "每一道筛子作用在上一道剩下的 token 上；被删的是 −inf，softmax 之后剩下的自动重新归一化", size=11)
    s.text(380, 324, "最后一格上的抽样：q_j ~ Exp(1)（带 seed 的行用它自己的 generator），token = argmax p_j / q_j",
           size=11, color="#a33")
    return s


def batch_layout() -> Svg:
    """E.4: three sequences of one step (decode, a chunk after a cached prefix, a new prompt) and the packed tensors."""
    P = 4
    seqs = [("A decode", 6, 1, [3, 8]), ("B chunk", 4, 3, [5, 1]), ("C 新 prompt", 0, 3, [9])]
    s = Svg(760, 372, "一步的 batch：每条序列算 [c, c + q) 的 token，打包成一维")
    s.text(380, 22, f"每条序列：已在 cache 里的 c 个 token（浅色）+ 这一步要算的 q 个（橙色）；block_size P = {P}", size=12)
    cw, x0 = 26, 190
    for r, (name, c, q, table) in enumerate(seqs):
        y = 40 + r * 44
        s.text(x0 - 10, y + 20, f"{name}：c = {c}，q = {q}", size=11, anchor="end", weight="bold")
        for t in range(c + q):
            s.box(x0 + t * cw, y + 4, cw - 2, 24, str(t), fill=C["hot"] if t >= c else C["kv"], size=10, mono=True,
                  rx=2)
        s.text(x0 + 7 * cw + 14, y + 20, f"block table {table}", size=11, anchor="start", mono=True)
    y = 196
    s.text(20, y - 12, "打包后的一维输入（N = Σq = 7 行），每一列是一个要算的 token：", size=12, weight="bold", anchor="start")
    cols = [(n, t, tab) for n, c, q, tab in seqs for t in range(c, c + q)]
    rows = [("input_ids", lambda n, t, tab: f"{n[0]}{t}"), ("positions", lambda n, t, tab: str(t)),
            ("slot_mapping", lambda n, t, tab: str(tab[t // P] * P + t % P))]
    for i, (label, f) in enumerate(rows):
        s.text(140, y + 22 + i * 34, label, size=11.5, anchor="end", mono=True)
        for j, (n, t, tab) in enumerate(cols):
            s.box(150 + j * 60, y + 4 + i * 34, 56, 26, f(n, t, tab), fill=C["hot"] if i == 0 else C["free"], size=11,
                  mono=True, rx=2)
    cu = [0, 1, 4, 7]
    y2 = y + 108
    s.text(140, y2 + 14, "cu_seqlens_q", size=11.5, anchor="end", mono=True)
    for v in cu:
        s.arrow(150 + v * 60 - 2, y2 - 4, 150 + v * 60 - 2, y2 - 14, arrow=True, color="#a33")
        s.text(150 + v * 60 - 2, y2 + 14, str(v), size=11, color="#a33", mono=True)
    s.text(380, y2 + 40, "slot = block_table[t // P]·P + t % P；input_ids 里的 A6 指 A 的第 6 号 token", size=10.5,
           color="#444")
    s.text(380, y2 + 60, "cu_seqlens_k = [0, 7, 14, 17]（c + q 的前缀和）：A 的 1 个 query 看 7 个 key，"
           "B 的 3 个 query 依次看 5、6、7 个（bottom-right 因果）", size=10.5, color="#444")
    return s


def engine_step() -> Svg:
    """E.5: one step of the engine loop and the two ways its events reach the caller."""
    s = Svg(760, 300, "引擎的一步：schedule → 归还槽位 → run → postprocess → 事件")
    boxes = [("schedule()", "e03：选出本步的\n序列与 token 数"), ("释放槽位", "waiting 里的序列\n还掉 GDN 槽位"),
             ("run()", "e04：拼 batch、前向\n采样（-1 = 不采样）"), ("postprocess()", "e03：追加 token\n判停、还 block"),
             ("事件", "num_tokens 变了的序列\n(id, token, finished)")]
    w, gap, y = 128, 20, 60
    for i, (name, what) in enumerate(boxes):
        x = 14 + i * (w + gap)
        s.box(x, y, w, 36, name, fill=C["gpu"] if name == "run()" else C["kv"], weight="bold", size=12, mono=i != 1 and i != 4)
        s.text(x + w / 2, y + 56, what, size=10.5, color="#333")
        if i:
            s.arrow(x - gap, y + 18, x - 1, y + 18)
    s.text(380, 34, "step() 不分 prefill / decode：每条序列让 num_cached_tokens 追 num_tokens，一步里什么都可能有", size=11.5)
    xe = 14 + 4 * (w + gap) + w / 2
    s.line([(xe, y + 86), (xe, 180)], arrow=True)
    s.box(420, 182, 200, 44, "generate()：收齐每个请求\n结束时一次返回（按输入顺序）", fill=C["mlp"], size=11)
    s.box(640, 182, 110, 44, "stream()：每个\n事件一到就 yield", fill=C["mlp"], size=11)
    s.line([(xe, 180), (520, 180)], arrow=False)
    s.arrow(520, 180, 520, 181)
    s.line([(630, y + 86), (630, 250), (6, 250), (6, y + 18), (12, y + 18)], dash=True)
    s.text(300, 244, "还有请求没结束：下一步（is_finished() 为假就继续 step）", size=11, color="#444")
    s.text(380, 284, "一个请求结束时，它在 e04 里的 GDN 槽位与 seed 的 generator 一起还回去；被抢占的序列回到 waiting，"
           "槽位在下一次 run 之前归还", size=10.5, color="#a33")
    return s


def serving_request() -> Svg:
    """E.6: a streaming request across the client, the event-loop thread and the engine thread."""
    s = Svg(760, 420, "一个流式请求：客户端、事件循环线程、引擎线程")
    lanes = [(110, "客户端（openai）"), (380, "事件循环线程（FastAPI）"), (650, "引擎线程（LLM）")]
    for x, title in lanes:
        s.box(x - 100, 16, 200, 30, title, fill=C["io"], weight="bold", size=12)
        s.line([(x, 46), (x, 404)], arrow=False, dash=True, color="#999")

    def msg(y, a, b, label, color="#333", dash=False):
        s.arrow(lanes[a][0], y, lanes[b][0] + (-4 if b > a else 4), y, color=color, dash=dash)
        s.text((lanes[a][0] + lanes[b][0]) / 2, y - 5, label, size=10.5, color=color)
    msg(74, 0, 1, "POST /v1/completions, stream=true")
    s.text(392, 98, "parse_request：字段逐个校验，错了 → 400（param 点名字段）", size=10, anchor="start", color="#444")
    msg(124, 1, 2, "命令 (\"add\", handle)，线程安全的队列")
    msg(148, 2, 1, "接受 / 拒绝（→ 400）", dash=True)
    s.rect(140, 160, 480, 26, fill=C["hot"], rx=4)
    s.text(380, 178, "这之前还能回干净的 400 / 503；发出 200 与 text/event-stream 之后，错误只能是一帧 SSE", size=10.5)
    msg(206, 1, 0, "HTTP 200，响应头")
    for i, y in enumerate((238, 272)):
        msg(y, 2, 1, "每步的事件 (id, token, finished)", color="#2a7")
        msg(y + 12, 1, 0, "data: {…}（TextStream 解出完整字符才发）" if i == 0 else "data: {…}", color="#2a7")
    msg(318, 2, 1, "finished = True", color="#2a7")
    msg(332, 1, 0, "带 finish_reason 的一帧；usage；[DONE]", color="#2a7")
    s.text(110, 362, "客户端断开", size=10.5, color="#a33")
    msg(378, 1, 2, "finally: release → (\"abort\", handle)", color="#a33")
    s.text(380, 404, "LLM 只被引擎线程碰：事件经 call_soon_threadsafe 放进请求自己的 asyncio.Queue；解码与 JSON 都在事件循环这边",
           size=10.5, color="#444")
    return s


FIGURES.update({"sampling-filters": sampling_filters, "batch-layout": batch_layout, "engine-step": engine_step,
                "serving-request": serving_request})


def wait_rule_timeline() -> Svg:
    """E.7: the wait rule over two steps: A stops at the branch point and snapshots, B and C wait, then restore."""
    P, shared, n = 16, 992, 1100                     # the card's walk-through: 62 blocks of P, 1100 tokens each
    s = Svg(760, 348, "等待规则：共享前缀只算一遍")
    s.text(380, 22, f"A、B、C 同一步到达，各 {n} 个 token，共享 1000 个 token 的 system prompt；"
           f"P = {P}，分叉点 {shared} = {shared // P} 块", size=12, weight="bold")
    legend = [(C["hot"], False, "本步计算"), (C["kv"], False, "KV 已算好（前一步算的 / 命中）"),
              (C["gdn"], False, "GDN 状态快照"), (C["free"], True, "还没算")]
    for lx, (fill, dash, label) in zip((120, 226, 430, 556), legend):
        s.rect(lx, 36, 18, 12, fill=fill, rx=2, dash=dash)
        s.text(lx + 24, 46, label, size=10.5, anchor="start", color="#333")
    x0s, bw, y0, rh = (70, 416), 250, 92, 70
    scale = bw / n

    def xs(x0, t):                                   # token position -> x in the column starting at x0
        return x0 + t * scale

    for i, x0 in enumerate(x0s):
        s.text(x0 + bw / 2, y0 - 14, f"第 {i + 1} 步", size=12, weight="bold")
    # per (step, request): segments (a, b, kind, label), snapshot marker label, note under the bar, first token
    rows = {
        (0, "A"): ([(0, shared, "hot", f"算 [0, {shared})"), (shared, n, "free", "")], "拍 h₆₁",
                   f"B 在等 → branch_point(A) = {shared}，切在 {shared}", False),
        (0, "B"): ([(0, n, "free", "等一步")], None,
                   f"要的 {shared // P} 块正被 A 算着；等来 {shared} 个，值得等", False),
        (0, "C"): ([(0, n, "free", "等一步")], None, "接纳停在 B（FCFS），C 排在后面", False),
        (1, "A"): ([(0, shared, "kv", "第 1 步算好"), (shared, n, "hot", "")], None,
                   f"接着算 [{shared}, {n})：{n - shared} 个 token", True),
        (1, "B"): ([(0, shared, "kv", f"命中 {shared // P} 块"), (shared, n, "hot", "")], "恢复 h₆₁",
                   f"num_cached_tokens = {shared}，只算 {n - shared} 个", True),
        (1, "C"): ([(0, shared, "kv", f"命中 {shared // P} 块"), (shared, n, "hot", "")], "恢复 h₆₁",
                   f"同 B：从 {shared} 的快照开始，算 {n - shared} 个", True),
    }
    for r, name in enumerate("ABC"):
        y = y0 + r * rh
        s.text(40, y + 20, name, size=13, weight="bold")
        for step, x0 in enumerate(x0s):
            segs, snap, note, first = rows[step, name]
            for a, b, kind, label in segs:
                s.box(xs(x0, a), y + 4, (b - a) * scale, 26, label, fill=C[kind], size=11, rx=2, dash=kind == "free")
                if kind == "hot" and a == shared:
                    s.text(xs(x0, (a + b) / 2) + 1.5, y + 21, str(b - a), size=10, mono=True)
            if snap:
                s.rect(xs(x0, shared) - 3, y, 6, 34, fill=C["gdn"], rx=1)
                s.text(xs(x0, shared), y - 4, snap, size=10, color="#333")
            s.text(x0, y + 48, note, size=10.5, anchor="start", color="#444")
            if first:
                s.text(x0 + bw + 8, y + 21, "✓ 首 token", size=10, anchor="start", color="#2a7")
    s.line([(408, y0 - 24), (408, y0 + 3 * rh - 8)], arrow=False, dash=True, color="#999")
    y = y0 + 3 * rh + 12
    s.text(380, y, f"第 1 步只算 A 的 {shared} 个 token：B 的 can_allocate 返回 False，wanted = {{A 的第 {shared // P - 1} 块}}；"
           f"第 2 步三条各算 {n - shared} 个，都在这一步出首 token", size=11)
    s.text(380, y + 20, f"system prompt 只算一遍，代价是 A 的首 token 晚一步；B、C 不等也要在 {shared} 切开、第 2 步才出首 token，"
           "还多算两遍 system prompt", size=11, color="#a33")
    return s


FIGURES.update({"wait-rule-timeline": wait_rule_timeline})
