"""Checks for E01 · Sampling (lessons/e01_sampling.md).

Oracle: HF transformers 5.17.0's warper chain TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper ->
MinPLogitsWarper (transformers.generation.logits_process, min_tokens_to_keep=1, the order of
GenerationMixin._get_logits_processor), applied row by row in fp32. Sampling is checked against the card's
contract (vLLM's exponential race with the row's own generator), by batch-composition scenarios and by
distribution tests with a bound computed for the sample size.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import transformers
from torch.overrides import TorchFunctionMode
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from checks.kit import Rand, assert_close, assert_dtype, assert_equal, explain_crash, impl, point, record_case

transformers.utils.logging.set_verbosity_error()

MODULE = "e01_sampling"
INF = math.inf

# the 易错点 of the card, as the messages name them
TEMP_AFTER = "temperature 在过滤之后才除（应最先除：top-k/top-p/min-p 都作用在 logits / temperature 上）"
TEMP_NONE = "没有除以 temperature"
CROSSING = ("top-p 差一位：把越过阈值的那个 token 也过滤掉了（HF 保留累计概率 >= top_p 的最小集合，"
            "升序累加时只删 cumsum <= 1 - top_p 的 token，且最大的那个永远保留）")
TOPK0 = "top_k=0 应表示“关闭”（保留全部 V 个），你把它当成 k=0 / 下标越界了"
MINP_ABS = "min_p 当成了绝对概率阈值（应为 min_p * p_max，相对最大概率）"
MINP_LE = ("min_p 的比较用了 <=：HF 删的是 p < min_p * p_max（严格小于），概率恰好等于阈值的 token 要保留"
           "——min_p=1 时最大的那个（以及与它并列的）都应留下")
TOPP_STRICT = ("top-p 的边界用了 <：升序累计概率恰好等于 1 - top_p 的 token 也要删（HF：cumsum <= 1 - top_p），"
               "并列的 logits 正好落在这个边界上")
TIES = "并列 logits 的取舍与约定相反：约定是升序 stable 排序（与 HF 在短行上一致），并列时 index 大的排在后面、先被保留"
TIES_UNSTABLE = ("排序不是 stable 的：torch.sort 默认不稳定，一行超过 16 个元素时并列 logits 的先后不确定；"
                 "约定是升序 stable 排序（torch.sort(..., stable=True)），并列时 index 小的排在前面、先被删")
TOPK_TIES = "top-k 只留了恰好 k 个（按 topk 的下标做 mask），丢了与第 k 大并列的 token（HF 删的是严格小于第 k 大的值）"
TOPP_OFF = ("top_p=1 时没有整体跳过 top-p：softmax 下溢成 0 的 token 满足 cumsum <= 1 - 1 = 0 被误删"
            "（HF 在 top_p=1 时根本不加这个 warper）")
GREEDY = "temperature=0 的行也去采样了：应直接取 argmax（并列取第一个）"
TINY = ("极小的正 temperature 没有当成 greedy：fp32 里 logits / 1e-40 是 inf，softmax 得到 NaN，每一步都采到同一个"
        "无意义的 token；小于 1e-5 的 temperature 应在 SamplingParams 里存成 0.0")
SHARED_GEN = ("所有行共用一个 generator（或一次从一个 generator 抽整个 [B, V] 的噪声）："
              "带 seed 的行的结果随 batch 里的其他行变化")
REGEN = ("每一步都按 seed 重新建 generator（或重置了它）：每一步抽到的是同一份噪声；generator 在请求到来时建一次，"
         "之后每一步都用传进来的那个（第 t 步是它的第 t 份噪声）")
NO_GEN = "没有用该行自己的 generator 抽噪声（用了全局 RNG），同一个 seed 两次运行结果不同"
BOOL = "校验没有排除 bool：True 是 int 的子类，isinstance(True, numbers.Real) 也为真，会被当成 1"
TYPE_FIRST = "校验时先比较大小再查类型：\"0.7\" >= 0 抛的是 TypeError，应先查类型、抛带字段名的 ValueError"
HALF = "softmax 等采样数学在 bf16/fp16 里做（应先 logits.float()，全部在 fp32 里算）"
OVERFLOW = ("超大的整数（10**400：JSON 的整数没有大小限制）转成 float 时抛 OverflowError，不是 ValueError："
            "float(10**400)、math.isfinite(10**400) 都会抛；要捕获它，报点名字段的 ValueError")
INT32 = ("top_k 放进了 int32 张量：合法的 top_k 可以大到 2**63 − 1（大于词表 = 不截断），int32 放不下 2**31 以上的值"
         "（torch.tensor(..., dtype=torch.int32) 溢出报错，.to(torch.int32) 则悄悄回绕成另一个 k，2**32 + 1 变成 1）；"
         "用 int64（或先 clamp 到 V）")
HUGE_K_UNCLAMPED = "top_k 大于词表时没有先截成 V：第 k 大的下标 V − k 成了负数（k = where(top_k > 0, top_k, V).clamp(max=V)）"
CONTRACT = ("与卡片约定的 exponential race 不一致：q = torch.empty(V).exponential_(generator=g)（fp32，形状 [V]，"
            "每个采样行从自己的 generator 抽一次），token = argmax(softmax(warp_logits) / q)")

MISTAKE_HINT = "\n  看起来像易错点："
STOP_FORMS = ("stop_token_ids 只对 list 逐个检查了元素：tuple、set 也是合法的写法，里面的负数、str、float 同样要报错"
              "（它们进了 frozenset，引擎每一步都拿 token 和它们比）")
FIELD_FIRST = ("ValueError 的消息没有以字段名开头：e06 的服务器把消息的第一个词当作 OpenAI 错误的 param 交给客户端，"
               "写成 \"top_p=1.5 must be ...\" 或 \"invalid top_p ...\"，客户端收到的 param 就是 \"top_p=1.5\" 或 \"invalid\"")

CRASHES = {
    "out of bounds": TOPK0,
    "index -1": TOPK0,
}


def _f32(x: float) -> float:
    """A Python float that is exactly representable in fp32 (so HF and a [B] fp32 tensor see the same value)."""
    return float(torch.tensor(x, dtype=torch.float32))


# ------------------------------------------------------------------------------------------- HF oracle

def hf_chain(temperature: float, top_k: int, top_p: float, min_p: float) -> LogitsProcessorList:
    """The warpers generate() builds for do_sample=True (GenerationMixin._get_logits_processor, same order)."""
    procs = [TemperatureLogitsWarper(temperature)]
    if top_k != 0:
        procs.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p))
    if min_p != 0.0:
        procs.append(MinPLogitsWarper(min_p=min_p))
    return LogitsProcessorList(procs)


def hf_warp(logits: torch.Tensor, T, k, p, mp) -> torch.Tensor:
    """Row by row through HF's chain: [B, V] -> [B, V]."""
    rows = [hf_chain(float(T[b]), int(k[b]), float(p[b]), float(mp[b]))(None, logits[b:b + 1].clone())
            for b in range(logits.shape[0])]
    return torch.cat(rows)


# ------------------------------------------------------------------------------- classic wrong answers

def _variant_row(row, T, k, p, mp, temp="first", keep_crossing=True, relative=True, flip_ties=False,
                 exact_k=False, p1_applies=False, strict_p=False, min_p_le=False):
    """One row through a plain re-implementation of the chain with one classic mistake switched on."""
    if flip_ties:                                   # reversed vocab: ties broken the other way round
        return _variant_row(row.flip(0), T, k, p, mp).flip(0)
    x = row / T if temp == "first" else row.clone()
    if k and exact_k:
        x = x.clone()
        x[torch.sort(x, stable=True).indices[:max(x.numel() - k, 0)]] = -INF
    elif k:
        x = x.masked_fill(x < torch.topk(x, min(k, x.numel())).values[-1], -INF)
    if p < 1 or p1_applies:
        sx, idx = torch.sort(x, stable=True)
        probs = sx.softmax(-1)
        cum = probs.cumsum(-1) - (0 if keep_crossing else probs)
        drop = cum < 1 - p if strict_p else cum <= 1 - p
        drop[-1] = False
        x = x.clone()
        x[idx[drop]] = -INF
    if mp or min_p_le:
        pr = x.softmax(-1)
        limit = mp * pr.max() if relative else mp
        x = x.masked_fill(pr <= limit if min_p_le else pr < limit, -INF)
    return x / T if temp == "last" else x


def _variant(logits, T, k, p, mp, **mistake) -> torch.Tensor:
    return torch.stack([_variant_row(logits[b], float(T[b]), int(k[b]), float(p[b]), float(mp[b]), **mistake)
                        for b in range(logits.shape[0])])


def _warp_mistakes(logits, T, k, p, mp, ties: bool = False) -> list:
    out = [(_variant(logits, T, k, p, mp, temp="last"), TEMP_AFTER),
           (_variant(logits, T, k, p, mp, temp="none"), TEMP_NONE),
           (_variant(logits, T, k, p, mp, keep_crossing=False), CROSSING),
           (_variant(logits, T, k, p, mp, relative=False), MINP_ABS),
           (_variant(logits, T, k, p, mp, p1_applies=True), TOPP_OFF),
           (_variant(logits, T, k, p, mp, exact_k=True), TOPK_TIES),
           (_variant(logits, T, k, p, mp, min_p_le=True), MINP_LE),
           (_variant(logits, T, k, p, mp, strict_p=True), TOPP_STRICT)]
    if ties:
        out.append((_variant(logits, T, k, p, mp, flip_ties=True), TIES))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    kept_a, kept_b = ~torch.isneginf(a), ~torch.isneginf(b)
    return (a.shape == b.shape and torch.equal(kept_a, kept_b)
            and torch.allclose(a.masked_fill(~kept_a, 0), b.masked_fill(~kept_b, 0), atol=1e-5, rtol=1e-5))


def assert_warp(out, logits, T, k, p, mp, r: Rand, what: str, ties: bool = False) -> None:
    """Same filtered set as HF row by row (exactly), and the kept values equal logits / temperature."""
    ref = hf_warp(logits, T, k, p, mp)
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{what}：应返回 torch.Tensor，得到 {type(out).__name__}；{r}")
    if out.shape != ref.shape:
        raise AssertionError(f"{what}：形状应为 {list(ref.shape)}，得到 {list(out.shape)}；{r}")
    assert_dtype(out, torch.float32, what=what)
    kept, ref_kept = ~torch.isneginf(out), ~torch.isneginf(ref)
    if torch.equal(kept, ref_kept):
        assert_close(out.masked_fill(~kept, 0), ref.masked_fill(~ref_kept, 0), what=f"{what} 保留下来的值", rand=r,
                     looks_like=[(w.masked_fill(torch.isneginf(w), 0), m)
                                 for w, m in _warp_mistakes(logits, T, k, p, mp)[:2]])
        return
    b, j = (int(i) for i in (kept != ref_kept).nonzero()[0])
    params = f"temperature={float(T[b]):.6g}, top_k={int(k[b])}, top_p={float(p[b]):.6g}, min_p={float(mp[b]):.6g}"
    msg = (f"{what}：第 {b} 行（{params}）的 token {j} 应{'保留' if ref_kept[b, j] else '过滤为 -inf'}，你的结果相反；"
           f"该行应保留 {int(ref_kept[b].sum())} 个 token，你保留了 {int(kept[b].sum())} 个；{r}")
    named = next((mistake for wrong, mistake in _warp_mistakes(logits, T, k, p, mp, ties=ties) if _same(out, wrong)),
                 None)
    empty = (~kept).all(dim=-1)
    if named is None and _same(out, ref.masked_fill((k == 0)[:, None], -INF)):   # exactly the top_k = 0 rows emptied
        named = f"top_k=0 的行被全部过滤成 -inf。{TOPK0}"
    if named is None and bool(empty.any()):
        msg += (f"\n  第 {int(empty.nonzero()[0])} 行被全部过滤成了 -inf：HF 每个 warper 都至少保留 1 个 token"
                "（min_tokens_to_keep=1），概率最大的那个永远留下")
    if named is None:                                          # top-k ties dropped, whichever tied ones were kept
        x = logits[b] / T[b]
        kb = int(k[b])
        if 0 < kb < x.numel() and bool((kept[b] <= ref_kept[b]).all()) and int(kept[b].sum()) <= kb \
                and int((x == torch.topk(x, kb).values[-1]).sum()) > 1:
            named = TOPK_TIES
    if named is not None:
        msg += f"\n  看起来像易错点：{named}"
    raise AssertionError(msg)


def random_params(r: Rand, rows: int, vocab: int):
    """Per-row parameters covering every switch: off values, top_p near 0 and near 1, min_p up to 1."""
    T, k, p, mp = [], [], [], []
    for _ in range(rows):
        T.append(_f32(r.choice([r.py.uniform(0.05, 0.5), r.py.uniform(0.5, 2.0), 1.0])))
        k.append(r.choice([0, 0, r.int(1, vocab), vocab, vocab + r.int(1, 5)]))
        p.append(_f32(r.choice([1.0, 1.0, r.py.uniform(0.05, 0.95), r.py.uniform(1e-7, 0.02),
                                1 - r.py.uniform(1e-6, 0.02)])))
        mp.append(_f32(r.choice([0.0, 0.0, r.py.uniform(0.01, 0.3), r.py.uniform(0.3, 1.0), 1.0])))
    return (torch.tensor(T), torch.tensor(k, dtype=torch.int64), torch.tensor(p), torch.tensor(mp))


# ------------------------------------------------------------------------------- sampling contract

def expected_tokens(logits: torch.Tensor, params: list, gens: list) -> list:
    """What the card's contract gives: argmax for temperature 0, else argmax(softmax(HF chain) / q),
    q = torch.empty(V).exponential_(generator=g) from the row's own generator; None where unseeded."""
    out = []
    for b, sp in enumerate(params):
        row = logits[b].float()
        if sp.temperature == 0:
            out.append(int(row.argmax()))
        elif gens[b] is None:
            out.append(None)
        else:
            probs = torch.softmax(hf_chain(sp.temperature, sp.top_k, sp.top_p, sp.min_p)(None, row[None].clone()), -1)
            q = torch.empty(row.numel()).exponential_(generator=gens[b])
            out.append(int((probs[0] / q).argmax()))
    return out


def random_request(m, r: Rand, vocab: int, seed=None, greedy: bool = False):
    """A random but valid SamplingParams (fp32-exact floats)."""
    return m.SamplingParams(
        temperature=0.0 if greedy else _f32(r.py.uniform(0.3, 1.8)),
        top_k=r.choice([0, 0, r.int(2, vocab)]),
        top_p=_f32(r.choice([1.0, r.py.uniform(0.5, 0.98)])),
        min_p=_f32(r.choice([0.0, 0.0, r.py.uniform(0.01, 0.2)])),
        seed=seed)


def _gens(m, seeds: list) -> list:
    with explain_crash(CRASHES):
        return [m.make_generator(s) for s in seeds]


def _check_tokens(tokens, rows: int, what: str) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise AssertionError(f"{what}：Sampler 应返回 torch.Tensor，得到 {type(tokens).__name__}")
    if list(tokens.shape) != [rows]:
        raise AssertionError(f"{what}：Sampler 应返回形状 [{rows}] 的 token ids，得到 {list(tokens.shape)}")
    assert_dtype(tokens, torch.int64, what=f"{what} 的 token ids")


# ------------------------------------------------------------------------------------------- checks

BAD = [  # (field, bad value[, the value the message must show]) -> ValueError naming the field and the value
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", True),
    ("temperature", "0.7"),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_k", "5"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", float("nan")), ("top_p", True),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", "0.1"),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True),
    ("seed", -1), ("seed", 1.5), ("seed", True), ("seed", "7"), ("seed", 2**64), ("seed", 10**30),
    ("top_k", 2**63), ("top_k", 10**30),
    ("stop_token_ids", [1, "2"], "2"), ("stop_token_ids", [7, 1.5], 1.5), ("stop_token_ids", [True], True),
    ("stop_token_ids", [3, -1], -1), ("stop_token_ids", 5),
    # every form the field accepts (list, tuple, set) through the same bounds
    ("stop_token_ids", (3, -1), -1), ("stop_token_ids", {4, "x"}, "x"), ("stop_token_ids", frozenset({2.5}), 2.5),
    # too large for a float: only the field name is asked for (the 401 digits need not be echoed)
    ("temperature", 10**400, None), ("top_p", 10**400, None), ("min_p", -10**400, None),
]


def _arg(value) -> str:
    """repr(value), with a power of ten beyond 10**100 written as 10**N (its digits would drown the message)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**100:
        return f"{'-' if value < 0 else ''}10**{len(str(abs(value))) - 1}"
    return repr(value)


REJECTED = {"temperature": "reject:temperature", "top_k": "reject:top_k", "top_p": "reject:top_p",
            "min_p": "reject:min_p", "max_tokens": "reject:max_tokens", "seed": "reject:seed",
            "stop_token_ids": "reject:stop_token_ids"}


def _record_rejected(name: str, value) -> None:
    """The contract cases one rejected value stands for (checks/contracts/e01.toml)."""
    record_case(REJECTED[name])
    record_case("message:field-name-first")
    if isinstance(value, bool):
        record_case("reject:bool")
    elif isinstance(value, str):
        record_case("reject:str")
    elif isinstance(value, int) and abs(value) >= 10**300:
        record_case("reject:int-too-large-for-float")
    elif isinstance(value, tuple):
        record_case("reject:stop_token_ids-tuple")
    elif isinstance(value, (set, frozenset)):
        record_case("reject:stop_token_ids-set")


@point("SamplingParams 校验：每个非法值都报 ValueError，消息以字段名开头、写出坏值")
def test_params_rejects_bad_values():
    m = impl(MODULE)
    r = Rand()
    for name, value, *shown in r.py.sample(BAD, len(BAD)):
        shown = shown[0] if shown else value
        try:
            m.SamplingParams(**{name: value})
        except ValueError as exc:
            text = str(exc)
            if name not in text or (shown is not None and str(shown) not in text and repr(shown) not in text):
                want = f"字段名 {name!r}" + ("" if shown is None else f" 和坏值 {shown!r}")
                raise AssertionError(f"SamplingParams({name}={_arg(value)}) 的 ValueError 应写出{want}，"
                                     f"得到：{text!r}") from None
            first = text.split(" ", 1)[0]                # what e06 hands the client as the error's `param`
            if first != name:
                raise AssertionError(f"SamplingParams({name}={_arg(value)}) 的 ValueError 应以字段名和一个空格开头"
                                     f"（{name} must ...），得到：{text!r}，第一个词是 {first!r}{MISTAKE_HINT}{FIELD_FIRST}") from None
            _record_rejected(name, value)
            continue
        except NotImplementedError:
            raise
        except Exception as exc:   # noqa: BLE001  a TypeError from comparing "abc" >= 0 is not the contract
            hint = TYPE_FIRST if isinstance(exc, TypeError) else OVERFLOW if isinstance(exc, OverflowError) else ""
            raise AssertionError(f"SamplingParams({name}={_arg(value)}) 应抛 ValueError（消息点名 {name!r}），得到 "
                                 f"{type(exc).__name__}: {exc}" + (f"\n  看起来像易错点：{hint}" if hint else "")) from None
        bools = isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value))
        hint = f"\n  看起来像易错点：{BOOL}" if bools else ""
        if name == "stop_token_ids" and not isinstance(value, list):
            hint = f"\n  看起来像易错点：{STOP_FORMS}"
        raise AssertionError(f"SamplingParams({name}={_arg(value)}) 应抛 ValueError（消息点名 {name!r}），但没有报错{hint}")


STOP_SET = ("stop_token_ids 原样存成了 list：引擎每生成一个 token 都问一次 token in stop_token_ids，"
            "一百万个 id 的列表每步都要扫一遍（存成 frozenset）")
GOOD = [dict(), dict(temperature=0), dict(temperature=0.0), dict(temperature=1), dict(temperature=2.5),
        dict(top_k=0), dict(top_k=1), dict(top_k=10**6), dict(top_p=1.0), dict(top_p=1), dict(top_p=1e-9),
        dict(min_p=0.0), dict(min_p=1.0), dict(seed=0), dict(seed=None), dict(seed=2**40), dict(seed=2**64 - 1),
        dict(top_k=2**63 - 1), dict(temperature=1e-5), dict(max_tokens=1),
        dict(stop_token_ids=[]), dict(stop_token_ids=[0, 151645]), dict(stop_token_ids=(5, 5)),
        dict(stop_token_ids={7}), dict(ignore_eos=True),
        dict(temperature=0.0, top_k=50, top_p=0.9, min_p=0.05, seed=7, max_tokens=16, stop_token_ids=[2])]


@point("SamplingParams 校验：合法的边界值（0、1、None、空列表）照常通过")
def test_params_accepts_edges():
    m = impl(MODULE)
    for kwargs in GOOD:
        try:
            sp = m.SamplingParams(**kwargs)
        except NotImplementedError:
            raise
        except Exception as exc:   # noqa: BLE001
            raise AssertionError(f"SamplingParams(**{kwargs}) 是合法的，却报了 {type(exc).__name__}: {exc}") from None
        for name, value in kwargs.items():
            if name == "stop_token_ids":                 # any list in, a set held: `in` at every token is O(1)
                held = getattr(sp, name)
                if not isinstance(held, (set, frozenset)) or held != set(value):
                    raise AssertionError(f"SamplingParams(**{kwargs}).stop_token_ids 应存成 frozenset({set(value)})，"
                                         f"得到 {held!r}\n  看起来像易错点：{STOP_SET}")
            elif getattr(sp, name) != value:
                raise AssertionError(f"SamplingParams(**{kwargs}).{name} 应为 {value!r}，得到 {getattr(sp, name)!r}")
    record_case("accept:edges")


@point("warp_logits 与 HF 的 warper 链逐行一致（随机的逐行参数）")
def test_warp_matches_hf():
    m = impl(MODULE)
    r = Rand()
    rows, vocab = r.int(16, 28), r.int(17, 160)
    logits = r.randn(rows, vocab, scale=r.choice([1.0, 2.0, 4.0]))
    T, k, p, mp = random_params(r, rows, vocab)
    with explain_crash(CRASHES):
        out = m.warp_logits(logits.clone(), T, k, p, mp)
    assert_warp(out, logits, T, k, p, mp, r, "warp_logits")
    record_case("warp:random-rows")


@point("并列与边界：ties、top_p→0/1、top_k=0 与 ≥V、min_p=0/1 都与 HF 一致")
def test_warp_edges_and_ties():
    m = impl(MODULE)
    r = Rand()
    vocab = r.int(4, 16)                            # HF's (unstable) sort is stable up to 16 entries
    edges = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1e-7, 0.0), (1.3, 0, 1 - 1e-6, 0.0), (1.0, vocab, 1.0, 0.0),
             (1.0, vocab + 3, 0.999, 0.0), (0.5, 1, 1.0, 0.0), (1.0, 2, 1.0, 0.0), (1.0, 0, 0.5, 0.0),
             (1.0, 0, 0.25, 0.0), (1.0, 0, 0.75, 0.0), (1.0, 0, 1.0, 1.0), (2.0, 0, 1.0, 0.5), (1.0, 3, 0.6, 0.2),
             (0.1, 0, 1.0, 0.0)]
    rows = len(edges) * 2
    logits = r.randint(-2, 3, (rows, vocab)).float()           # integer logits: many exact ties
    logits[len(edges):] = r.randn(len(edges), vocab)           # the same edges on continuous logits
    logits[len(edges) - 1::len(edges)] *= 40                   # top_p = 1 with probabilities that underflow to 0
    for b, edge in enumerate(edges):                           # a tie at the k-th largest value: HF keeps both
        kb = edge[1]
        if 0 < kb < vocab:
            where = r.py.sample(range(vocab), kb + 1)
            logits[b, where[:kb - 1]] = torch.arange(10.0, 10.0 - (kb - 1), -1.0)
            logits[b, where[kb - 1:]] = 5.0
    T, p, mp = (torch.tensor([_f32(e[i]) for e in edges] * 2) for i in (0, 2, 3))
    k = torch.tensor([e[1] for e in edges] * 2, dtype=torch.int64)
    with explain_crash(CRASHES):
        out = m.warp_logits(logits.clone(), T, k, p, mp)
    assert_warp(out, logits, T, k, p, mp, r, "warp_logits（并列与边界）", ties=True)
    everything_off = torch.tensor([e == (1.0, 0, 1.0, 0.0) for e in edges] * 2)
    assert_close(out[everything_off], logits[everything_off], what="全部关闭（T=1, top_k=0, top_p=1, min_p=0）的行",
                 rand=r)
    for case in ("edge:top_k=0", "edge:top_k>=V", "edge:top_p=1", "edge:top_p-tiny", "edge:tie-at-kth"):
        record_case(case)

    # exactly on the boundary, every run: n tied maxima (probabilities exactly 1/n, the rest underflow to 0),
    # top_p = j/n puts a cumulative sum exactly on 1 - top_p; min_p = 1 puts every tied maximum exactly on the
    # threshold p_max
    rows = []
    for n in (2, 4):
        for j in range(1, n + 1):
            rows.append((n, _f32(j / n), 0.0))
        rows.append((n, 1.0, 1.0))
    tied = torch.full((len(rows), vocab), -1e4)
    for b, (n, _, _) in enumerate(rows):
        tied[b, r.py.sample(range(vocab), n)] = 0.0
    T = torch.ones(len(rows))
    k = torch.zeros(len(rows), dtype=torch.int64)
    p, mp = torch.tensor([row[1] for row in rows]), torch.tensor([row[2] for row in rows])
    with explain_crash(CRASHES):
        out = m.warp_logits(tied.clone(), T, k, p, mp)
    assert_warp(out, tied, T, k, p, mp, r, "warp_logits（n 个并列最大值，top_p = j/n、min_p = 1 恰在边界上）", ties=True)
    record_case("edge:top_p=j/n")
    record_case("edge:min_p=1")

    # ties in rows longer than 16: torch's default (unstable) sort keeps index order only up to 16 entries, so there
    # HF's own pick among equal logits is the sort's accident. The contract is a stable ascending sort (ties in index
    # order): HF's chain on the same logits with each tie broken by its index (x + index * 1e-6), every top_p drawn
    # at least 1e-3 away from a cumulative sum so that the nudge cannot move the cut
    vocab = r.int(17, 64)
    long_ties = r.randint(0, 4, (6, vocab)).float()
    nudged = long_ties + torch.arange(vocab) * 1e-6
    cuts = []
    for row in nudged:
        cum = torch.softmax(row, -1).sort().values.cumsum(0)
        cuts.append(next(x for x in (r.py.uniform(0.05, 0.95) for _ in range(1000))
                         if float((cum - (1 - x)).abs().min()) > 1e-3))
    T, k, mp = torch.ones(6), torch.zeros(6, dtype=torch.int64), torch.zeros(6)
    p = torch.tensor(cuts)
    with explain_crash(CRASHES):
        out = m.warp_logits(long_ties.clone(), T, k, p, mp)
    want = hf_warp(nudged, T, k, p, mp)
    if isinstance(out, torch.Tensor) and out.shape == want.shape \
            and not torch.equal(torch.isneginf(out), torch.isneginf(want)):
        b = int((torch.isneginf(out) != torch.isneginf(want)).any(-1).nonzero()[0])
        flipped = torch.equal(torch.isneginf(out), torch.isneginf(hf_warp(long_ties - torch.arange(vocab) * 1e-6,
                                                                           T, k, p, mp)))
        raise AssertionError(f"warp_logits（V = {vocab} 的整数 logits，许多并列，top_p = {float(p[b]):.4f}）：第 {b} 行"
                             f"过滤掉的 token 与“并列按 index 顺序”的约定不同；{r}{MISTAKE_HINT}"
                             + (TIES if flipped else TIES_UNSTABLE))
    record_case("edge:ties-longer-than-16")


@point("temperature=0（及小于 1e-5 的正值）的行取 argmax（并列取第一个），不受 top-k/top-p/seed 影响")
def test_greedy_rows_take_argmax():
    m = impl(MODULE)
    r = Rand()
    tiny = [1e-40, 10 ** -r.py.uniform(5.01, 44), 10 ** -r.py.uniform(5.01, 8)]
    for t in tiny:
        stored = m.SamplingParams(temperature=t).temperature
        assert stored == 0.0, f"SamplingParams(temperature={t!r}).temperature 应存成 0.0（greedy），得到 {stored!r}\n  {TINY}"
    rows, vocab = r.int(16, 24), r.int(40, 100)
    logits = r.randn(rows, vocab)
    tie_rows = list(range(0, rows, 3))
    for b in tie_rows:                                         # two equal maxima: argmax takes the first
        i, j = sorted(r.py.sample(range(vocab), 2))
        logits[b, i] = logits[b, j] = logits[b].max() + 1
    greedy = [b % 4 != 3 for b in range(rows)]
    params = [random_request(m, r, vocab, seed=r.choice([None, r.int(0, 10**6)]), greedy=g) for g in greedy]
    for b in range(1, rows, 4):                                # greedy by a tiny positive temperature
        params[b] = dataclasses.replace(params[b], temperature=tiny[b % len(tiny)])
        logits[b, 0] = logits[b].min() - 1                     # a NaN row's argmax would be token 0: never the answer
    gens = _gens(m, [sp.seed for sp in params])
    sampler = m.Sampler()
    for step in range(3):
        with explain_crash(CRASHES):
            tokens = sampler(logits, params, gens)
        _check_tokens(tokens, rows, "Sampler")
        _assert_greedy(tokens, logits, torch.tensor(greedy), f"第 {step} 步 temperature=0 的行", r)
    all_greedy = [m.SamplingParams(temperature=0.0) for _ in range(rows)]
    with explain_crash(CRASHES):
        tokens = sampler(logits, all_greedy, [None] * rows)
    _check_tokens(tokens, rows, "Sampler（全部 greedy）")
    _assert_greedy(tokens, logits, torch.ones(rows, dtype=torch.bool), "全部 greedy 的 batch", r)
    for case in ("greedy:temperature=0", "greedy:tiny-temperature", "greedy:tied-maxima", "greedy:mixed-batch"):
        record_case(case)


def _assert_greedy(tokens, logits, rows, what: str, r: Rand) -> None:
    want = logits.argmax(dim=-1)[rows]
    got = tokens[rows]
    if torch.equal(got, want):
        return
    last_max = (logits.shape[-1] - 1 - logits.flip(-1).argmax(dim=-1))[rows]
    ties_only = torch.equal(got, last_max)
    mistake = "并列最大值应取第一个（torch.argmax 的约定），你取了最后一个" if ties_only else GREEDY
    assert_equal(got, want, what=what, rand=r, looks_like=[(got, mistake)])


@point("固定 seed：每一步的 token 都等于卡片约定的 exponential race")
def test_seeded_tokens_follow_the_contract():
    m = impl(MODULE)
    r = Rand()
    rows, vocab = r.int(8, 14), r.int(30, 300)
    seeds = [r.int(0, 2**31 - 1) if b % 5 != 4 else None for b in range(rows)]
    params = [random_request(m, r, vocab, seed=s, greedy=(b % 7 == 6)) for b, s in enumerate(seeds)]
    gens = _gens(m, seeds)
    mirror = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    sampler = m.Sampler()
    for step in range(3):
        logits = r.randn(rows, vocab, scale=2.0)
        want = expected_tokens(logits, params, mirror)
        fresh = expected_tokens(logits, params, [torch.Generator().manual_seed(s) if s is not None else None
                                                 for s in seeds])        # a generator re-created this step
        with explain_crash(CRASHES):
            tokens = sampler(logits.clone(), params, gens)
        _check_tokens(tokens, rows, "Sampler")
        wrong = [b for b, w in enumerate(want) if w is not None and int(tokens[b]) != w]
        if wrong:
            b, sp = wrong[0], params[wrong[0]]
            regen = step > 0 and all(int(tokens[i]) == fresh[i] for i, w in enumerate(want) if w is not None)
            raise AssertionError(f"第 {step} 步第 {b} 行（seed={sp.seed}, temperature={sp.temperature}, "
                                 f"top_k={sp.top_k}, top_p={sp.top_p}, min_p={sp.min_p}）得到 token "
                                 f"{int(tokens[b])}，按约定应为 {want[b]}（同一个 generator 从第 0 步一直用下来）："
                                 f"{GREEDY if sp.temperature == 0 else CONTRACT}"
                                 f"{MISTAKE_HINT + REGEN if regen else ''}；{r}")
    record_case("seed:exponential-race-steps")
    record_case("seed:unseeded-rows")


def _as_int32(top_k: list[int]) -> list[int]:
    """What int32 makes of each top_k (two's complement wrap); <= 0 is off."""
    return [max((k + 2**31) % 2**32 - 2**31, 0) for k in top_k]


@point("超大的合法 top_k（2**31 到 2**63 − 1，远大于词表）等于不截断：不溢出、不回绕")
def test_huge_top_k_means_no_cut():
    m = impl(MODULE)
    r = Rand()
    vocab = r.int(20, 60)
    # 2**32 + 1 and 2**33 + j wrap to 1 and j in int32: a real cut; the others overflow it or wrap to <= 0
    huge = [2**32 + 1, 2**33 + r.int(2, 3), 2**31, 2**40 + r.int(0, 99), 2**63 - 1]
    rows = len(huge)
    logits = r.randn(rows, vocab, scale=0.5)                   # flat: a cut to 1-3 tokens shows within a few steps
    T = torch.full((rows,), _f32(r.py.uniform(1.0, 1.5)))
    k = torch.tensor(huge, dtype=torch.int64)
    p, mp = torch.ones(rows), torch.zeros(rows)
    with explain_crash({"out of bounds": HUGE_K_UNCLAMPED, "index -": HUGE_K_UNCLAMPED}):
        out = m.warp_logits(logits.clone(), T, k, p, mp)
    what = f"warp_logits（top_k = {huge}，V = {vocab}）"
    if isinstance(out, torch.Tensor) and out.shape == logits.shape and not _same(out, hf_warp(logits, T, k, p, mp)) \
            and _same(out, hf_warp(logits, T, torch.tensor(_as_int32(huge)), p, mp)):
        raise AssertionError(f"{what}：大于词表的 top_k 应等于不截断，你的结果像是 top_k 回绕成了 "
                             f"{_as_int32(huge)}{MISTAKE_HINT}{INT32}；{r}")
    assert_warp(out, logits, T, k, p, mp, r, what)

    seeds = [r.int(0, 2**31 - 1) for _ in huge]
    params = [m.SamplingParams(temperature=float(T[0]), top_k=kk, seed=s) for kk, s in zip(huge, seeds)]
    wrapped = [dataclasses.replace(sp, top_k=kk) for sp, kk in zip(params, _as_int32(huge))]
    gens, mirror = _gens(m, seeds), [torch.Generator().manual_seed(s) for s in seeds]
    sampler = m.Sampler()
    for step in range(6):
        states = [g.get_state() for g in mirror]
        want = expected_tokens(logits, params, mirror)
        with explain_crash({"converted to type int32": INT32}):
            tokens = sampler(logits.clone(), params, gens)
        _check_tokens(tokens, rows, "Sampler（top_k 远大于词表）")
        if tokens.tolist() == want:
            continue
        b = next(i for i, w in enumerate(want) if int(tokens[i]) != w)
        like = expected_tokens(logits, wrapped, [torch.Generator().set_state(s) for s in states])
        hint = MISTAKE_HINT + INT32 if tokens.tolist() == like else ""
        raise AssertionError(f"第 {step} 步第 {b} 行（top_k={huge[b]}，V = {vocab}，seed={seeds[b]}）得到 token "
                             f"{int(tokens[b])}，按约定应为 {want[b]}：大于词表的 top_k 等于不截断（与 top_k=0 相同）"
                             f"{hint}；{r}")
    record_case("top_k:2**31..2**63-1")


@point("同一个 seed：单独跑、混在不同的 batch 里、重跑一次，token 都相同")
def test_seed_independent_of_batch():
    m = impl(MODULE)
    r = Rand()
    vocab, steps = r.int(50, 200), 4
    seed = r.int(0, 2**31 - 1)
    mine = random_request(m, r, vocab, seed=seed)
    mine.temperature, mine.top_k, mine.top_p = _f32(r.py.uniform(1.0, 1.5)), 0, 1.0   # high entropy: any slip shows
    rows = r.int(5, 9)
    where = r.int(1, rows - 1)                                 # never first, so "use generators[0]" shows up
    others = [random_request(m, r, vocab, seed=r.choice([None, r.int(0, 2**31 - 1)]), greedy=(b == 0))
              for b in range(rows - 1)]
    batch_params = others[:where] + [mine] + others[where:]
    logits = [r.randn(rows, vocab) for _ in range(steps)]
    sampler = m.Sampler()

    def run(params, rows_of_logits, label):
        gens = _gens(m, [sp.seed for sp in params])
        got = []
        for step in range(steps):
            with explain_crash(CRASHES):
                tokens = sampler(logits[step][rows_of_logits].clone(), params, gens)
            _check_tokens(tokens, len(params), label)
            got.append(tokens)
        return torch.stack(got)                                # [steps, rows]

    alone = run([mine], [where], "单独一行")[:, 0]
    again = run([mine], [where], "单独一行（重跑）")[:, 0]
    if not torch.equal(alone, again):
        raise AssertionError(f"seed={seed} 的请求单独跑两次得到 {alone.tolist()} 和 {again.tolist()}\n"
                             f"  看起来像易错点：{NO_GEN}；{r}")
    in_batch = run(batch_params, list(range(rows)), "batch")[:, where]
    if not torch.equal(alone, in_batch):
        raise AssertionError(f"seed={seed} 的请求单独跑得到 {alone.tolist()}，放在 {rows} 行 batch 的第 {where} 行得到 "
                             f"{in_batch.tolist()}\n  看起来像易错点：{SHARED_GEN}；{r}")
    twin = batch_params + [mine]                               # the same seed twice in one batch
    both = run(twin, list(range(rows)) + [where], "batch（同一 seed 出现两次）")
    if not torch.equal(both[:, where], both[:, -1]):
        raise AssertionError(f"同一个 batch 里两个 seed={seed} 的相同请求得到 {both[:, where].tolist()} 和 "
                             f"{both[:, -1].tolist()}\n  看起来像易错点：{SHARED_GEN}；{r}")
    record_case("seed:alone-batched-rerun")


@point("分布检验：经验频率接近 softmax(warp_logits)，被过滤的 token 从不出现")
def test_distribution():
    m = impl(MODULE)
    r = Rand()
    vocab = r.int(6, 10)
    logits = r.randn(1, vocab, scale=1.5)
    configs = [m.SamplingParams(temperature=_f32(r.py.uniform(0.5, 0.8))),
               m.SamplingParams(temperature=_f32(r.py.uniform(1.2, 2.0)), top_k=vocab - 2),
               m.SamplingParams(temperature=1.0, top_p=_f32(r.py.uniform(0.6, 0.85)), min_p=_f32(0.1))]
    sampler = m.Sampler()
    draws = 3000
    for seeded, sp in zip((0, draws // 2, draws), configs):        # no row, half the rows, every row seeded
        probs = torch.softmax(hf_chain(sp.temperature, sp.top_k, sp.top_p, sp.min_p)(None, logits.clone()), -1)[0]
        first = r.int(0, 10**6)                                     # one seed each
        gens = _gens(m, list(range(first, first + seeded))) + [None] * (draws - seeded)
        torch.manual_seed(r.seed)                                   # the unseeded half uses the global RNG
        with explain_crash(CRASHES):
            tokens = sampler(logits.expand(draws, vocab).clone(), [sp] * draws, gens)
        _check_tokens(tokens, draws, "Sampler")
        outside = sorted(set(tokens.tolist()) - set((probs > 0).nonzero().flatten().tolist()))
        if outside:
            raise AssertionError(f"（temperature={sp.temperature}, top_k={sp.top_k}, top_p={sp.top_p}, "
                                 f"min_p={sp.min_p}）采样到了被过滤的 token {outside}：过滤后的 token 概率必须是 0；{r}")
        freq = torch.bincount(tokens, minlength=vocab).double() / draws
        tv = 0.5 * float((freq - probs.double()).abs().sum())
        # E[TV] <= 0.5 * sum sqrt(p(1-p)/n); McDiarmid: P(TV > E + t) <= exp(-2 n t^2) = 1e-6
        bound = 0.5 * float((probs.double() * (1 - probs.double()) / draws).sqrt().sum()) + math.sqrt(
            math.log(1e6) / (2 * draws))
        if tv > bound:
            raise AssertionError(
                f"（temperature={sp.temperature}, top_k={sp.top_k}, top_p={sp.top_p}, min_p={sp.min_p}）{draws} 次采样"
                f"的经验分布与 softmax(warp_logits) 的全变差距离为 {tv:.3f}，超过此样本量的上界 {bound:.3f}：\n"
                f"  经验频率 {[round(v, 3) for v in freq.tolist()]}\n  应接近   {[round(v, 3) for v in probs.tolist()]}\n"
                f"  （token = argmax(probs / q)，q ~ Exp(1)；乘 q、或用 logits 代替 probs 都不是正确的采样）；{r}")
    record_case("dist:empirical-frequencies")


class _HalfMath(TorchFunctionMode):
    """Records arithmetic (division, softmax, cumsum, noise, ...) whose result is bf16 / fp16."""
    OPS = {"softmax", "log_softmax", "div", "truediv", "rtruediv", "mul", "rmul", "sub", "rsub", "add", "radd", "exp",
           "log", "cumsum", "exponential", "pow", "reciprocal", "sum", "amax", "logsumexp"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "").strip("_")
        if name in self.OPS and isinstance(out, torch.Tensor) and out.dtype in (torch.bfloat16, torch.float16):
            self.seen.append(f"{name}({out.dtype})")
        return out


@point("bf16/fp16 的 logits 也在 fp32 里采样（token 与 fp32 输入相同）")
def test_half_logits_sampled_in_fp32():
    m = impl(MODULE)
    r = Rand()
    rows, vocab = r.int(8, 12), r.int(100, 300)
    sampler = m.Sampler()
    for dtype in (torch.bfloat16, torch.float16):
        seeds = [r.int(0, 2**31 - 1) for _ in range(rows)]
        params = [random_request(m, r, vocab, seed=s, greedy=(b == 0)) for b, s in enumerate(seeds)]
        gens_half, gens_full = _gens(m, seeds), _gens(m, seeds)
        for step in range(3):
            # distinct multiples of 1/32 in [-8, 8): exact in bf16 and fp16, so .float() loses nothing
            half = torch.stack([torch.randperm(511, generator=r.gen)[:vocab] - 255 for _ in range(rows)]).to(dtype) / 32
            spy = _HalfMath()
            with explain_crash(CRASHES), spy:
                tokens = sampler(half.clone(), params, gens_half)
            if spy.seen:
                raise AssertionError(f"{dtype} 的 logits：Sampler 里有运算在半精度中进行"
                                     f"（{', '.join(sorted(set(spy.seen)))}）\n  看起来像易错点：{HALF}；{r}")
            _check_tokens(tokens, rows, f"Sampler（{dtype} logits）")
            with explain_crash(CRASHES):
                full = sampler(half.float(), params, gens_full)
            if tokens.tolist() != full.tolist():
                raise AssertionError(f"同样的值、同样的 seed：{dtype} 的 logits 第 {step} 步得到 {tokens.tolist()}，"
                                     f"转成 fp32 再传入得到 {full.tolist()}\n  看起来像易错点：{HALF}；{r}")
        record_case({torch.bfloat16: "dtype:bf16", torch.float16: "dtype:fp16"}[dtype])


@point("卡片例子：V=5 的逐步过滤与 seed=0/1 的 exponential race")
def test_card_example():
    m = impl(MODULE)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0]])
    f32 = lambda v: torch.tensor([v])                                   # noqa: E731
    i64 = lambda v: torch.tensor([v], dtype=torch.int64)                # noqa: E731
    stages = [  # (top_k, top_p, min_p) at temperature 0.5, and the expected output
        ((0, 1.0, 0.0), [4.0, 3.0, 2.0, 0.0, -2.0]),
        ((4, 1.0, 0.0), [4.0, 3.0, 2.0, 0.0, -INF]),
        ((4, 0.9, 0.0), [4.0, 3.0, 2.0, -INF, -INF]),
        ((4, 0.9, 0.3), [4.0, 3.0, -INF, -INF, -INF]),
    ]
    for (k, p, mp), want in stages:
        with explain_crash(CRASHES):
            out = m.warp_logits(logits.clone(), f32(0.5), i64(k), f32(p), f32(mp))
        if not (isinstance(out, torch.Tensor) and _same(out, torch.tensor([want]))):
            msg = (f"卡片例子 logits=[2, 1.5, 1, 0, -1]、temperature=0.5、top_k={k}、top_p={p}、min_p={mp}："
                   f"应得到 {want}，得到 {out.tolist() if isinstance(out, torch.Tensor) else out}")
            for wrong, name in _warp_mistakes(logits, f32(0.5), i64(k), f32(p), f32(mp)):
                if isinstance(out, torch.Tensor) and _same(out, wrong):
                    msg += f"\n  看起来像易错点：{name}"
                    break
            raise AssertionError(msg)
    final = m.warp_logits(logits.clone(), f32(0.5), i64(4), f32(0.9), f32(0.3))
    assert_close(torch.softmax(final, -1), torch.tensor([[0.7311, 0.2689, 0.0, 0.0, 0.0]]),
                 what="卡片例子最终的 softmax", atol=1e-4, rtol=0)
    sampler = m.Sampler()
    sp = m.SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.3)
    for seed, want in ((0, 1), (1, 0)):
        with explain_crash(CRASHES):
            token = sampler(logits.clone(), [sp], [m.make_generator(seed)])
        _check_tokens(token, 1, "卡片例子")
        if int(token[0]) != want:
            raise AssertionError(f"卡片例子 seed={seed}：q = torch.empty(5).exponential_(generator=make_generator({seed}))，"
                                 f"argmax(probs / q) 应为 token {want}，得到 {int(token[0])}：{CONTRACT}")
    greedy = sampler(logits.clone(), [m.SamplingParams(temperature=0.0, top_k=4, top_p=0.9, min_p=0.3)],
                     [m.make_generator(0)])
    assert_equal(greedy, torch.tensor([0]), what="卡片例子 temperature=0",
                 looks_like=[(torch.tensor([1]), GREEDY)])
    batch = m.warp_logits(logits.expand(3, 5).clone(), torch.tensor([1.0, 0.5, 2.0]), torch.tensor([0, 2, 0]),
                          torch.tensor([1.0, 1.0, 0.6]), torch.tensor([0.0, 0.0, 0.5]))
    want = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0], [4.0, 3.0, -INF, -INF, -INF], [1.0, 0.75, 0.5, -INF, -INF]])
    if not (isinstance(batch, torch.Tensor) and _same(batch, want)):
        raise AssertionError(f"卡片 L1 例子（3 行、逐行参数）：应得到 {want.tolist()}，得到 "
                             f"{batch.tolist() if isinstance(batch, torch.Tensor) else batch}")
    ties = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = m.warp_logits(ties.clone(), f32(1.0), i64(0), f32(0.5), f32(0.0))
    if not _same(out, torch.tensor([[-INF, 1.0, 1.0, -INF]])):
        raise AssertionError(f"卡片例子 logits=[1, 1, 1, 0]、top_p=0.5：HF 保留 token 1 和 2，应得到 [-inf, 1, 1, -inf]，"
                             f"得到 {out.tolist()}\n  看起来像易错点：{TIES}")
    record_case("card:V=5")
