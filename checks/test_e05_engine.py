"""Checks for E05 · the engine loop (lessons/e05_engine.md): the end-to-end tests that matter.

Oracle: HF `generate` (greedy, eager, fp32, explicit attention_mask, no eos) on the same checkpoint,
one prompt at a time; and the engine's own unconstrained run for the stress test.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import re
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from checks import hf_models
from checks.kit import Rand, explain_crash, impl, point, record_case
from checks.sampling_contract import ContractSampler

MODULE = "e05_engine"
BAD_INPUT = {
    "index out of range": "没有检查 token id 是否在词表内 [0, vocab_size)：越界的 id 在 embedding 里崩溃",
    "empty prompt": "一个坏请求让整批请求都失败：add_request 的 ValueError 应只记在这个请求的输出里",
    "temperature must": "一个坏请求让整批请求都失败：add_request 的 ValueError 应只记在这个请求的输出里",
    "unexpected keyword": "拼错的采样参数名（TypeError）应变成这个请求的 ValueError",
}
ENGINE_CRASHES = {
    "GDN state pool exhausted": ("结束的请求没有 runner.release(seq)：GDN 状态槽位没有归还，"
                                 "max_num_seqs 个槽位很快用完（step 里每个结束的序列都要 release）"),
    **BAD_INPUT,
}
BLOCK_SIZE = ("Sequence 的 block_size 与引擎的不一致：add_request 创建 Sequence 后要设 seq.block_size = "
              "self.config.block_size（Sequence.block_size 是类属性，同一进程里别的引擎可能用别的块大小）")
STREAM_ABORT = ("中途退出 stream 后请求没有 abort：stream 的循环要放进 try/finally，调用者 break（生成器被 close）时"
                "finally 里 abort 每个还没结束的请求，归还 block 和 GDN 槽位")
REQUESTS_LEAK = "generate / stream 返回结果后没有把请求从 self.requests 里删掉（pop）：调用越多，表越大（内存泄漏）"
ABORT_SLOT = "abort 运行中的请求时没有 runner.release(seq)：它的 GDN 状态槽位（和 generator）一直被占着"
PREEMPT_SLOT = "抢占后没有归还 GDN 状态槽位，重算时带着旧的 conv / recurrent 状态"
ADD_FAILED_LEAK = ("scheduler.add 抛 ValueError（KV 池永远放不下）的请求留在了 self.requests 里：要等 scheduler.add 成功之后"
                   "再登记 requests[seq.seq_id]，被拒绝的请求不留痕迹")
TQDM_COUNT = ("generate(use_tqdm=True) 的进度条应按本步结束的请求数前进，总数是被接受的请求数（坏请求不算）："
              "每步 bar.update(本步 finished 的事件数)")
NEW_TOKENS = 32


@contextlib.contextmanager
def _engine(what: str):
    """explain_crash for engine calls, and an assert without a message (inside an exercise file) turned into a
    message naming the file, the line and, when recognisable, the broken contract."""
    try:
        with explain_crash(ENGINE_CRASHES):
            yield
    except AssertionError as exc:
        if "set seq.block_size" in str(exc):
            raise AssertionError(f"{what}：{exc}\n  看起来像易错点：{BLOCK_SIZE}") from exc
        if str(exc):
            raise
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        line = (frame.line or "").strip()
        where = "/".join(Path(frame.filename).parts[-2:])
        msg = f"{what}：{where} 第 {frame.lineno} 行的 assert 失败（没有消息）：{line}"
        if "block_size" in line:
            msg += f"\n  看起来像易错点：{BLOCK_SIZE}"
        raise AssertionError(msg) from exc


def _probe() -> None:
    """Call into the engine once on a 1-layer dummy model before any costly HF work (a stub fails fast)."""
    m, e01, m06 = impl(MODULE), impl("e01_sampling"), impl("m06_models")
    config = hf_models.tiny_config("qwen3", Rand(0), vocab=16, layers=1)
    m.LLM(m06.init_dummy_weights(m06.build_model(config))).generate([[1, 2]], _greedy(e01, 1))


@functools.lru_cache(maxsize=None)
def _case(family: str, seed: int):
    """A tiny HF model of `family` saved to a folder, 8+ prompts (some sharing a prefix) and HF's greedy answers."""
    r = Rand(seed)
    config = hf_models.tiny_config(family, r, vocab=80, layers=2)
    hf = hf_models.hf_model(family, config, r)
    shared = r.randint(1, 80, (12,)).tolist()
    prompts = [r.randint(1, 80, (r.int(1, 20),)).tolist() for _ in range(6)]
    prompts += [shared + r.randint(1, 80, (r.int(1, 6),)).tolist() for _ in range(3)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(p):].tolist())
    folder = Path(tempfile.mkdtemp(prefix=f"course-e05-{family}-"))
    hf_models.save_hf(hf, folder)
    _HF[folder] = hf
    return folder, prompts, refs


_HF: dict = {}
TIE = 1e-3   # a first divergence where HF's top-2 logits are closer than this is a numerical tie, not a bug


def _greedy(e01, n=NEW_TOKENS):
    return e01.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(family: str, r: Rand, **engine_kwargs):
    m, e01 = impl(MODULE), impl("e01_sampling")
    _probe()
    folder, prompts, refs = _case(family, r.seed)
    llm = m.LLM(str(folder), **engine_kwargs)
    with _engine(f"{family} 的 generate（{engine_kwargs}）"):
        outs = llm.generate(prompts, _greedy(e01))
    return llm, prompts, refs, outs, _HF[folder]


def _is_tie(hf, prompt: list[int], ref: list[int], j: int, ours: int) -> bool:
    """HF's logits where we first diverge: is our token within TIE of HF's choice?"""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:j]])).logits[0, -1]
        logits = logits if logits.dim() == 1 else logits[-1]
    return float(logits[ref[j]] - logits[ours]) < TIE


def _assert_same(outs, refs, prompts, what: str, r: Rand, hf=None) -> None:
    ties = 0
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.error is None, f"{what}：请求 {i} 出错：{out.error}"
        if out.token_ids != ref:
            diverge = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), min(len(ref), len(out.token_ids)))
            if (hf is not None and len(out.token_ids) == len(ref) and ties == 0
                    and _is_tie(hf, prompts[i], ref, diverge, out.token_ids[diverge])):
                ties += 1      # one near-tie per batch is accepted; what follows it legitimately differs
                continue
            raise AssertionError(f"{what}：请求 {i}（prompt 长 {len(prompts[i])}）从第 {diverge} 个新 token 起与 HF generate 不同\n"
                                 f"  得到 {out.token_ids}\n  期望 {ref}\n  {r}")


@point("greedy 输出与 HF generate 逐 token 一致（qwen3 / qwen3_moe / qwen3_5_moe_text，9 条不同长度的 prompt，32 个新 token）")
def test_greedy_matches_hf():
    r = Rand()
    for family in ("qwen3", "qwen3_moe", "qwen3_5_moe_text"):
        llm, prompts, refs, outs, hf = _run(family, r)
        _assert_same(outs, refs, prompts, f"{family} 的 greedy 输出", r, hf)
        record_case(f"greedy:{family}")


@point("prefix 共享：命中的 block 数 > 0，输出不变")
def test_prefix_cache_hits():
    r = Rand()
    llm, prompts, refs, outs, hf = _run("qwen3", r, block_size=r.choice([2, 4, 8]), max_num_seqs=r.int(2, 4),
                                        max_num_batched_tokens=r.int(32, 64))
    _assert_same(outs, refs, prompts, "prefix caching 打开时的输出", r, hf)
    hits = llm.stats["prefix_hit_blocks"]
    assert hits > 0, f"3 条 prompt 共享 12 个 token 的前缀，却没有一个 block 命中 prefix cache（stats={llm.stats}）"
    record_case("prefix:hits")


@point("chunked prefill：max_num_batched_tokens 小到必须分块，输出不变")
def test_chunked_prefill():
    r = Rand()
    for family in ("qwen3", "qwen3_5_moe_text"):
        llm, prompts, refs, outs, hf = _run(family, r, max_num_batched_tokens=r.int(4, 8), max_num_seqs=4,
                                            block_size=r.choice([2, 4, 8]))
        _assert_same(outs, refs, prompts, f"{family}：token 预算 {llm.config.max_num_batched_tokens}、block_size {llm.config.block_size} 时的输出", r, hf)
        record_case(f"chunked:{family}")


@point("抢占：KV 池很小，发生了抢占（计数 > 0），输出不变，block 全部归还")
def test_preemption():
    r = Rand()
    for family in ("qwen3", "qwen3_5_moe_text"):
        llm, prompts, refs, outs, hf = _run(family, r, block_size=4, num_kvcache_blocks=14, max_num_seqs=r.int(4, 6),
                                            max_num_batched_tokens=r.int(16, 32))
        try:
            _assert_same(outs, refs, prompts, f"{family}：14 个 KV block 时的输出", r, hf)
        except AssertionError as exc:
            if family.startswith("qwen3_5"):
                raise AssertionError(f"{exc}\n  看起来像易错点：抢占后没有归还 GDN 状态槽位，重算时带着旧的 conv / recurrent 状态") from exc
            raise
        stats = llm.stats
        assert stats["preemptions"] > 0, f"{family}：KV 池只有 14 个 block 却没有发生抢占（stats={stats}）"
        assert stats["free_blocks"] == stats["total_blocks"], f"{family}：结束后 block 没有全部归还（stats={stats}）"
        record_case(f"preempt:{family}")


@point("压力测试：300+ 个请求、很小的 KV 池，全部完成且与不受限运行逐 token 一致，block 全部归还")
def test_stress():
    m, e01, m06 = impl(MODULE), impl("e01_sampling"), impl("m06_models")
    r = Rand()
    _probe()
    config = hf_models.tiny_config("qwen3", r, vocab=64, layers=1)
    model = m06.init_dummy_weights(m06.build_model(config), seed=r.seed, std=0.2).eval()
    prompts = [r.randint(0, 64, (r.int(1, 12),)).tolist() for _ in range(320)]
    params = [e01.SamplingParams(temperature=0.0, max_tokens=r.int(1, 10), ignore_eos=True) if i % 3 else
              e01.SamplingParams(temperature=1.0, top_k=8, seed=i, max_tokens=r.int(1, 10), ignore_eos=True)
              for i in range(len(prompts))]
    with _engine("压力测试（不受限运行）"):
        free = m.LLM(model, max_num_seqs=64, num_kvcache_blocks=512, block_size=4).generate(prompts, params)
    tight = m.LLM(model, max_num_seqs=16, num_kvcache_blocks=12, block_size=4, max_num_batched_tokens=24)
    tight.runner.sampler = contract = ContractSampler(tight.runner.sampler, "压力测试（12 个 KV block，有抢占）", r)
    with _engine("压力测试（12 个 KV block）"):
        outs = tight.generate(prompts, params)
    contract.verify()                          # seeded requests against the contract itself, not only the other run
    for i, (a, b) in enumerate(zip(outs, free)):
        assert a.error is None and a.finished, f"请求 {i} 没有完成：{a}"
        assert a.token_ids == b.token_ids, (f"请求 {i}：小 KV 池（有抢占）与不受限运行的输出不同：{a.token_ids} vs {b.token_ids}；{r}")
    stats = tight.stats
    assert stats["preemptions"] > 0, f"12 个 block 的池子应该逼出抢占（stats={stats}）"
    assert stats["free_blocks"] == stats["total_blocks"], f"结束后有 block 没归还（泄漏）：{stats}"
    record_case("stress:320-requests-seeded-and-greedy")


@point("坏输入：空 prompt、超长 prompt、越界 token id、非法采样参数各自报清楚的错，其余请求照常完成")
def test_bad_input_is_isolated():
    m, e01 = impl(MODULE), impl("e01_sampling")
    r = Rand()
    _probe()
    folder, prompts, refs = _case("qwen3", r.seed)
    llm = m.LLM(str(folder), max_model_len=64)
    good = _greedy(e01)
    vocab = 80                                 # _case's models; the first bad id is exactly vocab_size, then one beyond
    batch = [prompts[0], [], list(range(1, 70)), [5, vocab, 3, vocab + 15], prompts[1], [7, -1, 2]]
    params = [good] * len(batch)
    stderr = io.StringIO()
    with _engine("坏输入的 generate"), contextlib.redirect_stderr(stderr):
        outs = llm.generate(batch, params)
    _assert_same([outs[0], outs[4]], [refs[0], refs[1]], [prompts[0], prompts[1]], "坏请求旁边的正常请求", r)
    for i, needle in ((1, "empty"), (2, "max_model_len"), (3, "vocab"), (5, "vocab")):
        assert outs[i].error and needle in outs[i].error, (
            f"坏请求 {i}（prompt {batch[i] if len(batch[i]) < 8 else '…'}）的错误信息应提到 {needle!r}，得到 {outs[i].error!r}"
            + ("（-1 也不在 [0, vocab_size) 里：只查了上界？）" if i == 5 else ""))
        assert outs[i].token_ids == [], f"坏请求 {i} 不应产生 token"
    record_case("bad:empty")
    record_case("bad:too-long")
    record_case("bad:id>=vocab")
    record_case("bad:id<0")
    record_case("bad:neighbours-complete")
    named = re.sub(r"\[\s*0\s*,\s*\d+\s*\)", "", outs[3].error)          # without the range "[0, 80)" itself
    assert re.search(rf"(?<!\d){vocab}(?!\d)", named), (
        f"prompt {batch[3]} 的错误信息应写出第一个越界的 id {vocab}（= vocab_size：词表是 [0, {vocab})，{vocab} 已经越界），"
        f"得到 {outs[3].error!r}" + ("；只报了后面的 " + str(vocab + 15) + "：上界写成了 <= vocab_size？"
                                  if str(vocab + 15) in named else ""))
    assert not re.search(r"\d+%\|", stderr.getvalue()), \
        f"generate(use_tqdm=False)（默认）不应画进度条，stderr 里却有：{stderr.getvalue()[-200:]!r}"
    # every form sampling_params takes: a SamplingParams, a dict (valid, bad value, misspelled field), another type
    as_dict = dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with _engine("非法采样参数的 generate"):
        outs = llm.generate(prompts[:5], [dict(temperature=-1.0), good, dict(temprature=0.0), as_dict, 0.5])
    assert outs[0].error and "temperature" in outs[0].error, f"非法 temperature 的错误信息：{outs[0].error!r}"
    assert outs[2].error and "temprature" in outs[2].error, f"拼错的采样参数名应是这个请求自己的错误：{outs[2].error!r}"
    _assert_same([outs[1]], [refs[1]], [prompts[1]], "非法采样参数旁边的正常请求", r)
    record_case("params:dict-bad-value")
    record_case("params:dict-misspelled-field")
    if outs[3].error is not None:
        raise AssertionError(f"sampling_params 为合法的 dict {as_dict}：应按 SamplingParams(**d) 接受，得到错误 {outs[3].error!r}；{r}")
    _assert_same([outs[3]], [refs[3]], [prompts[3]], f"sampling_params 为 dict {as_dict} 的请求", r, _HF[folder])
    record_case("params:dict-valid")
    if not outs[4].error or outs[4].token_ids:
        raise AssertionError(f"sampling_params 为 0.5（既不是 SamplingParams、dict，也不是 None）：应是这个请求自己的 "
                             f"ValueError，得到 error={outs[4].error!r}、token_ids={outs[4].token_ids}；{r}")
    record_case("params:other-type")
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([], good)
    assert not llm.has_unfinished(), "被拒绝的请求不应留在队列里"
    record_case("bad:add_request-raises-queues-nothing")


@point("streaming：逐 token 产出，按请求拼起来等于 generate 的结果")
def test_streaming():
    m, e01 = impl(MODULE), impl("e01_sampling")
    r = Rand()
    folder, prompts, refs = _case("qwen3", r.seed)
    # a budget below the longest prompt (the shared prefix alone is 12 tokens): partial prefill steps every run
    llm = m.LLM(str(folder), max_num_batched_tokens=r.int(8, 12), max_num_seqs=r.int(3, 8),
                block_size=r.choice([4, 8, 16]))
    got = {i: [] for i in range(len(prompts))}
    finished, events = set(), 0
    _probe()
    with _engine("stream"):
        for index, token, done, error in llm.stream(prompts, _greedy(e01)):
            assert error is None and index not in finished, f"请求 {index} 结束后又产出了 token"
            got[index].append(token)
            events += 1
            if done:
                finished.add(index)
    assert finished == set(got), "有请求没有收到 finished 事件"
    assert events == NEW_TOKENS * len(prompts), (f"stream 产出了 {events} 个 token 事件，应为 {NEW_TOKENS * len(prompts)}"
                                                 "\n  看起来像易错点：stream 攒到请求结束才一次性吐出（应在采样出每个 token 的那一步就 yield）")
    _assert_same([type("O", (), {"token_ids": got[i], "error": None}) for i in got], refs, prompts, "stream 的输出", r)
    record_case("stream:per-token-events")
    assert max(map(len, prompts)) > llm.config.max_num_batched_tokens     # the check's own premise
    record_case("stream:partial-prefill-no-event")
    _assert_idle(llm, "stream 全部读完之后", r)
    record_case("stream:requests-emptied")


M_SPECIAL = "\n  看起来像易错点：解码时没有 skip_special_tokens=True，特殊 token 的字面进了输出文本"


@point("文本进出：有 tokenizer 时接受字符串、返回解码后的文本（特殊 token 不进文本）")
def test_text_in_text_out():
    m, e01, m06 = impl(MODULE), impl("e01_sampling"), impl("m06_models")
    from course.runtime.tiny_tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    r = Rand()
    config = hf_models.tiny_config("qwen3", r, vocab=len(tok), layers=1)
    model = m06.init_dummy_weights(m06.build_model(config), seed=r.seed).eval()
    llm = m.LLM(model, tokenizer=tok)
    with _engine("文本进出"):
        out = llm.generate(["你好，Qwen"], _greedy(e01, 6))[0]
    assert out.prompt_token_ids == tok.encode("你好，Qwen"), "字符串 prompt 应该用 tokenizer 编码"
    want = tok.decode(out.token_ids, skip_special_tokens=True)
    if (len(out.token_ids) == 6 and out.text != want
            and out.text == tok.decode(out.token_ids, skip_special_tokens=False)):       # random weights drew one
        raise AssertionError(f"生成的 token {out.token_ids} 里有特殊 token，得到的文本 {out.text!r} 含它的字面" + M_SPECIAL)
    assert len(out.token_ids) == 6 and out.text == want, f"输出文本应是生成 token 的解码：{out}"
    record_case("text:str-prompt-decoded")
    # every run: the model is pushed to emit special tokens (<|im_start|>, then eos <|im_end|>)
    special, eos = tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id
    plain = model.compute_logits
    calls = []

    def pushed(hidden):
        logits = plain(hidden).clone()
        calls.append(1)
        logits[:, special if len(calls) % 3 else eos] += 1e4
        return logits

    model.compute_logits = pushed
    llm = m.LLM(model, tokenizer=tok)
    with _engine("文本进出（特殊 token）"):
        out = llm.generate(["Qwen"], [e01.SamplingParams(temperature=0.0, max_tokens=6)])[0]
    model.compute_logits = plain
    if out.text is None or "<|" in out.text or out.text != tok.decode(out.token_ids, skip_special_tokens=True):
        raise AssertionError(f"生成了特殊 token {out.token_ids}（{special} = <|im_start|>，{eos} = eos <|im_end|>），"
                             f"文本应按 skip_special_tokens=True 解码、不含它们，得到 {out.text!r}" + M_SPECIAL)
    record_case("text:special-tokens-skipped")


@point("卡片例子：6 个 KV block 上的一次 generate（6 步、两次抢占、一个坏请求）")
def test_card_example():
    m, e01 = impl(MODULE), impl("e01_sampling")
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=None,
                      tie_word_embeddings=False)
    llm = m.LLM(cfg, block_size=4, num_kvcache_blocks=6, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64)
    greedy = [_greedy(e01, n) for n in (5, 4, 3, 3)]
    prompts = [[11, 12, 13, 14, 15], list(range(20, 30)), [], [40, 41, 42]]
    with _engine("卡片例子的 stream"):
        events = list(llm.stream(prompts, greedy))
    assert events[0][0] == 2 and events[0][1] is None and "empty" in (events[0][3] or ""), \
        f"空 prompt 应先得到一个带错误的事件，得到 {events[0]}"
    assert events[0][2] is True, f"被拒绝的请求的事件 finished 应为 True（它已经结束，不会再有事件），得到 {events[0]}"
    tokens = {i: [t for j, t, _, _ in events[1:] if j == i] for i in (0, 1, 3)}
    assert tokens == {0: [28, 4, 58, 20, 63], 1: [41, 26, 41, 26], 3: [34, 22, 48]}, f"卡片例子的 token：{tokens}"
    stats = llm.stats
    assert (stats["steps"], stats["preemptions"], stats["prefix_hit_blocks"]) == (6, 2, 3), \
        f"卡片例子应是 6 步、2 次抢占、3 个命中的 block，得到 {stats}"
    assert stats["free_blocks"] == 6, f"结束后 6 个 block 应全部空闲：{stats}"
    record_case("card:6-steps-2-preemptions-bad-request")
    record_case("card:partial-prefill-no-event")       # B's 10-token prompt takes two steps under a budget of 8


# ------------------------------------------------------------------------------------ cleanup and boundaries

def _dummy(m06, family: str, r: Rand, vocab: int = 64):
    config = hf_models.tiny_config(family, r, vocab=vocab, layers=1 if family == "qwen3" else None)
    return m06.init_dummy_weights(m06.build_model(config), seed=r.seed, std=0.2).eval()


def _assert_idle(llm, what: str, r: Rand, slot_mistake: str | None = None) -> None:
    """Nothing queued, every block free, every GDN slot free, the requests table empty. slot_mistake: what a held
    GDN slot means at this point (the earlier stages of the check have ruled out the other causes)."""
    stats = llm.stats
    if llm.has_unfinished():
        raise AssertionError(f"{what}：调度器里还有请求（waiting {len(llm.scheduler.waiting)}、running "
                             f"{len(llm.scheduler.running)}）\n  看起来像易错点：{STREAM_ABORT}；{r}")
    if stats["free_blocks"] != stats["total_blocks"]:
        raise AssertionError(f"{what}：还有 {stats['total_blocks'] - stats['free_blocks']} 个 KV block 没有归还"
                             f"（stats={stats}）；{r}")
    pool = llm.runner.gdn_pool
    if pool is not None and pool.slot_of:
        hint = f"\n  看起来像易错点：{slot_mistake}" if slot_mistake else ""
        raise AssertionError(f"{what}：GDN 状态池里还有 {len(pool.slot_of)} 个槽位被占着（序列 {sorted(pool.slot_of)}）"
                             f"{hint}；{r}")
    if llm.requests:
        raise AssertionError(f"{what}：self.requests 里还留着 {len(llm.requests)} 个请求 {sorted(llm.requests)}"
                             f"\n  看起来像易错点：{REQUESTS_LEAK}；{r}")


@point("资源回收：多次 generate、中途退出 stream、abort 运行中的请求（混合模型）之后，block、GDN 槽位、requests 全部归还")
def test_cleanup():
    m, e01, m06 = impl(MODULE), impl("e01_sampling"), impl("m06_models")
    r = Rand()
    _probe()
    model = _dummy(m06, "qwen3_5_text", r)
    seqs = r.int(2, 3)
    kw = dict(block_size=r.choice([2, 4, 8]), max_num_seqs=seqs, max_num_batched_tokens=r.int(seqs + 4, 24),
              num_kvcache_blocks=256, max_model_len=r.int(48, 96))
    llm = m.LLM(model, **kw)
    prompts = [r.randint(0, 64, (r.int(1, 12),)).tolist() for _ in range(2 * seqs + 2)]   # more than the GDN slots
    for call in range(3):
        with _engine(f"混合模型、{kw} 的第 {call + 1} 次 generate"):
            outs = llm.generate(prompts, _greedy(e01, r.int(2, 6)))
        assert all(o.finished and o.error is None for o in outs), f"第 {call + 1} 次 generate 有请求没完成：{outs}"
        _assert_idle(llm, f"第 {call + 1} 次 generate 之后", r, ENGINE_CRASHES["GDN state pool exhausted"])
    record_case("cleanup:generate-x3-more-requests-than-slots")

    stream = llm.stream(prompts, _greedy(e01, 8))
    with _engine("stream"):
        for _ in range(r.int(seqs + 1, 2 * seqs + 1)):         # some requests are running mid-generation
            next(stream)
    stream.close()                                             # what a consumer's `break` does to the generator
    if llm.has_unfinished() or llm.stats["free_blocks"] != llm.stats["total_blocks"]:
        raise AssertionError(f"调用者读了几个事件就退出 stream（生成器被 close）之后，请求还在调度器里或 block 没归还"
                             f"（stats={llm.stats}）\n  看起来像易错点：{STREAM_ABORT}；{r}")
    # generate has released finished requests above, and the queues are empty: what holds a slot now was aborted
    _assert_idle(llm, "中途退出 stream 之后（stream 的 finally 对没结束的请求调 abort）", r, ABORT_SLOT)
    record_case("cleanup:stream-closed-midway")

    ids = [llm.add_request(p, _greedy(e01, 12)) for p in prompts[:seqs]]
    with _engine("abort 之前的 step"):
        while not any(s.num_completion_tokens >= 2 for s in llm.scheduler.running):
            llm.step()
    victim = next(s for s in llm.scheduler.running if s.num_completion_tokens >= 2)
    llm.abort(victim.seq_id)
    if victim.seq_id in llm.runner.gdn_pool.slot_of:
        raise AssertionError(f"abort 了运行中的请求 {victim.seq_id}，它的 GDN 槽位还在状态池里\n"
                             f"  看起来像易错点：{ABORT_SLOT}；{r}")
    with _engine("abort 之后的 step"):
        while llm.has_unfinished():
            llm.step()
    for rid in ids:
        llm.requests.pop(rid, None)                            # add_request/step: the caller collects the outputs
    _assert_idle(llm, "abort 一个运行中的请求、其余请求完成之后", r)
    record_case("cleanup:abort-running-hybrid")


@point("抢占（混合模型、带 seed 的采样）：被抢占的序列归还 GDN 槽位、从零状态重算，带 seed 的 token 按 e01 的约定")
def test_preemption_hybrid_seeded():
    m, e01, m06 = impl(MODULE), impl("e01_sampling"), impl("m06_models")
    r = Rand()
    _probe()
    model = _dummy(m06, "qwen3_5_text", r)
    bs, n, new = r.choice([2, 4]), 3, 10
    prompts = [r.randint(0, 64, (r.int(2, 3 * bs),)).tolist() for _ in range(n)]
    need = [-(-(len(p) + new) // bs) for p in prompts]        # blocks each request ends with
    pool = max(need) + sum(need) // 3                          # each fits alone, all three never fit together
    seeds = r.py.sample(range(2**31), n)
    params = [e01.SamplingParams(temperature=1.0, seed=seeds[i], max_tokens=new, ignore_eos=True) if i % 2 == 0
              else _greedy(e01, new) for i in range(n)]
    free = m.LLM(copy.deepcopy(model), block_size=bs, num_kvcache_blocks=256, max_num_seqs=n, max_model_len=128)
    with _engine("不受限的对照运行"):
        ref = free.generate(prompts, params)
    tight = m.LLM(model, block_size=bs, num_kvcache_blocks=pool, max_num_seqs=n, max_model_len=128,
                  max_num_batched_tokens=r.int(8, 16))
    tight.runner.sampler = contract = ContractSampler(tight.runner.sampler, f"{pool} 个 KV block 的混合模型", r)
    ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
    with _engine(f"{pool} 个 KV block 的混合模型"):
        while tight.has_unfinished():
            tight.step()
            held = [s.seq_id for s in tight.scheduler.waiting if s.seq_id in tight.runner.gdn_pool.slot_of]
            if held:
                raise AssertionError(f"step 之后被抢占、回到 waiting 的序列 {held} 还占着 GDN 槽位"
                                     f"\n  看起来像易错点：{PREEMPT_SLOT}；{r}")
    assert tight.stats["preemptions"] > 0, f"检查本身的问题：{pool} 个 block 没有逼出抢占（stats={tight.stats}）"
    contract.verify()
    for i, rid in enumerate(ids):
        got, want = tight.requests[rid].completion_token_ids, ref[i].token_ids
        if got != want:
            raise AssertionError(f"请求 {i}（{'seed=' + str(seeds[i]) if i % 2 == 0 else 'greedy'}）：有抢占时得到 {got}，"
                                 f"不受限运行得到 {want}\n  看起来像易错点：{PREEMPT_SLOT}；{r}")
    record_case("preempt-hybrid:slot-released-seeded")


@point("边界：prompt 恰好 max_model_len 被拒绝、max_model_len - 1 生成 1 个 token，bool / 非 int 的 token id 被拒绝，调用者的 prompt 列表不被改动，每个 Sequence 用引擎的 block_size")
def test_boundaries():
    m, e01, e02, m06 = impl(MODULE), impl("e01_sampling"), impl("e02_block_manager"), impl("m06_models")
    r = Rand()
    _probe()
    model = _dummy(m06, "qwen3", r)
    limit, bs = r.int(8, 20), r.choice([2, 4, 8])
    e02.Sequence.block_size = r.choice([b for b in (3, 16, 32) if b != bs])    # another engine's block size
    llm = m.LLM(model, block_size=bs, max_model_len=limit, num_kvcache_blocks=64)
    full, one_less = r.randint(0, 64, (limit,)).tolist(), r.randint(0, 64, (limit - 1,)).tolist()
    batch = [full, one_less, [1, True, 3], [2, 5.0], r.randint(0, 64, (r.int(1, limit - 2),)).tolist()]
    before = copy.deepcopy(batch)
    with _engine(f"max_model_len={limit}、block_size={bs} 的 generate"):
        outs = llm.generate(batch, _greedy(e01, 5))
    if not (outs[0].error and "max_model_len" in outs[0].error):
        raise AssertionError(f"prompt 恰好 {limit} = max_model_len 个 token：一个 token 都生成不了，应被拒绝并在错误里"
                             f"写明 max_model_len；得到 error={outs[0].error!r}、token_ids={outs[0].token_ids}"
                             f"（len(prompt) >= max_model_len 就拒绝，不是 >）；{r}")
    if outs[1].error or len(outs[1].token_ids) != 1 or not outs[1].finished:
        raise AssertionError(f"prompt 有 max_model_len - 1 = {limit - 1} 个 token：应被接受，生成恰好 1 个 token 后因 "
                             f"max_model_len 结束；得到 error={outs[1].error!r}、token_ids={outs[1].token_ids}；{r}")
    for i, what in ((2, "bool（True 是 int 的子类）"), (3, "float")):
        if not outs[i].error or outs[i].token_ids:
            raise AssertionError(f"prompt {before[i]} 含 {what} 的 token id，应被拒绝（ValueError 记在这个请求的 error 里）；"
                                 f"得到 error={outs[i].error!r}、token_ids={outs[i].token_ids}；{r}")
    if batch != before:
        raise AssertionError(f"generate 改动了调用者传进来的 prompt 列表：之前 {before}，之后 {batch}"
                             f"（Sequence 要保存自己的副本再往里追加 token）；{r}")
    record_case("boundary:prompt==max_model_len")
    record_case("boundary:prompt==max_model_len-1")
    record_case("boundary:bool-id")
    record_case("boundary:float-id")
    record_case("boundary:caller-list-unchanged")
    with _engine("add_request"):
        rid = llm.add_request(r.randint(0, 64, (r.int(1, 6),)).tolist(), _greedy(e01, 3))
    got = llm.requests[rid].block_size
    llm.abort(rid)
    if got != bs:
        raise AssertionError(f"引擎 block_size={bs}，add_request 创建的 Sequence 的 block_size 却是 {got}"
                             f"\n  看起来像易错点：{BLOCK_SIZE}；{r}")
    record_case("boundary:seq-block_size")

    # sampling_params left out (None -> SamplingParams()), with a progress bar over the accepted requests only
    shorts = [r.randint(0, 64, (r.int(1, 4),)).tolist() for _ in range(r.int(2, 3))]
    stderr = io.StringIO()
    with _engine("generate(prompts, use_tqdm=True)（不给 sampling_params）"), contextlib.redirect_stderr(stderr):
        outs = llm.generate(shorts + [[]], use_tqdm=True)
    for i, out in enumerate(outs[:-1]):
        if out.error is not None or not out.finished or not out.token_ids:
            raise AssertionError(f"不给 sampling_params（None）时应使用默认的 SamplingParams()：请求 {i} 得到 "
                                 f"error={out.error!r}、finished={out.finished}、token_ids={out.token_ids}；{r}")
    if not outs[-1].error:
        raise AssertionError(f"空 prompt 应得到带 error 的输出，得到 {outs[-1]}；{r}")
    record_case("params:None-default")
    last = stderr.getvalue().strip().split("\r")[-1].strip()                # the bar as it was left on screen
    counts = re.findall(r"(\d+)/(\d+)", last)
    if counts != [(str(len(shorts)), str(len(shorts)))]:
        raise AssertionError(f"generate(use_tqdm=True)：{len(shorts)} 个被接受的请求（另有 1 个空 prompt 被拒绝）全部结束后，"
                             f"进度条最后应显示 {len(shorts)}/{len(shorts)}，得到 {last or '没有进度条'!r}"
                             f"\n  看起来像易错点：{TQDM_COUNT}；{r}")
    record_case("generate:tqdm-counts-finished-requests")

    # a request the KV pool can never hold: scheduler.add's ValueError, and no trace of it anywhere
    small = m.LLM(model, block_size=2, num_kvcache_blocks=4, max_model_len=64)
    huge, fits = r.randint(0, 64, (r.int(9, 14),)).tolist(), r.randint(0, 64, (r.int(1, 3),)).tolist()
    with _engine("4 个 KV block 的 generate（有一个永远放不下的请求）"):
        outs = small.generate([huge, fits], _greedy(e01, 3))
    if not outs[0].error or outs[0].token_ids:
        raise AssertionError(f"prompt 长 {len(huge)}、KV 池只有 4 个 2-token block：scheduler.add 的 ValueError 应记在这个请求的 "
                             f"error 里，得到 error={outs[0].error!r}、token_ids={outs[0].token_ids}；{r}")
    if outs[1].error or len(outs[1].token_ids) != 3:
        raise AssertionError(f"放得下的请求应照常生成 3 个 token，得到 {outs[1]}；{r}")
    if any(s.prompt_token_ids == huge for s in small.requests.values()):
        raise AssertionError(f"{ADD_FAILED_LEAK}；{r}")
    with pytest.raises(ValueError):
        small.add_request(huge, _greedy(e01, 3))
    if small.has_unfinished() or small.requests:
        raise AssertionError(f"add_request 因 KV 池放不下而抛 ValueError 之后，调度器或 self.requests 里多出了东西"
                             f"（waiting {len(small.scheduler.waiting)}、requests {sorted(small.requests)}）\n"
                             f"  看起来像易错点：{ADD_FAILED_LEAK}；{r}")
    _assert_idle(small, "KV 池放不下的请求被拒绝之后", r)
    record_case("bad:pool-can-never-hold-no-trace")
