"""Every speed figure in a card or the book comes from a result file or from a derivation written next to it.

A sentence that compares speed or throughput (快/慢/加速/吞吐/tok/s/带宽 ..., faster, speed-up) and carries a
figure (2×, 1.5 倍, 快一倍, 30%) fails unless the figure is
- rendered from a committed result file: a ```result block or an inline {{ results/<file>.json expr | fmt }}
  (the figure then is not in the source text at all), or
- a bound derived in the text: the paragraph (or table, or list item) carries the marker
  `<!-- derivation: what the figure is derived from -->`, which names the derivation (an HTML comment: invisible in
  the book, shown as is in the terminal card).
Code (fenced blocks and `inline code`) is not prose and is skipped. A × between two operands (128×128, 256 × 8) is a
product or a shape, not a speed-up, and a % in a sentence without a speed word (an error bound, a probability) is
not a claim about speed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("lessons/*.md"), *ROOT.glob("book/**/*.md")])

MARKER = re.compile(r"<!--\s*derivation:\s*(\S.*?)\s*-->", re.S)
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_RESULT = re.compile(r"\{\{\s*results/\S+\.json\s+.+?\s*\}\}")
CODE = re.compile(r"`[^`\n]+`")
COMMENT = re.compile(r"<!--.*?-->", re.S)

_NUM = r"(?:\d+(?:\.\d+)?|[一两二三四五六七八九十几半数]+)"
# a multiplier that is not a product (128×128, 2I×H and 256 × 8 have a second operand), or a percentage
FIGURE = re.compile(rf"{_NUM}(?:×(?![\d(（\[a-zA-Z])|\s+×(?!\s)|\s*倍|x\b)|\d+(?:\.\d+)?\s*%|翻倍|翻一番")
SPEED = re.compile(r"快(?!照)|慢|加速|提速|吞吐|耗时|延迟|tok/s|token/s|带宽|throughput|speed|faster|slower|latency",
                   re.I)
SENTENCE_END = re.compile(r"(?<=[。！？!?])|(?<=\.)\s")


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, list item and table row, code and result blocks blanked out."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out, start, lines = [], 0, []
    for i, line in enumerate(text.split("\n") + [""], 1):
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s|\s*\|", line)
        if not line.strip() or item:
            if lines:
                out.append((start, "\n".join(lines)))
            lines, start = ([line], i) if line.strip() else ([], 0)
            continue
        if not lines:
            start = i
        lines.append(line)
    return out


def claims(text: str) -> list[tuple[int, str]]:
    """(line, sentence) of every unmarked sentence with a speed figure in a page's Markdown."""
    found = []
    for line, block in blocks(text):
        if MARKER.search(block):
            continue
        prose = COMMENT.sub("", CODE.sub("", INLINE_RESULT.sub("", block)))
        prose = re.sub(r"\s*\n\s*", "", prose)          # Chinese lines are wrapped without a space
        for sentence in SENTENCE_END.split(prose):
            if FIGURE.search(sentence) and SPEED.search(sentence):
                found.append((line, sentence.strip()))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_speed_figures_are_rendered_or_derived(page):
    bad = claims(page.read_text(encoding="utf-8"))
    assert not bad, (f"{page.relative_to(ROOT)}: a speed figure that no result file renders and no marked "
                     "derivation backs (render it with a ```result block or {{ results/... }}, or write the "
                     "bound's derivation and mark it <!-- derivation: ... -->):\n"
                     + "\n".join(f"  line {n}: {s[:160]}" for n, s in bad))


@pytest.mark.parametrize("sentence", [
    "读一半的字节，kernel 就接近快一倍。",
    "decode 时 fp8_linear 比 bf16 F.linear 快 1.5 倍以上。",
    "The fused kernel is 2× faster than the loop.",
    "w8a8 在 prefill 上提速 30%。",
    "吞吐比 bf16 高 1.27×。",
])
def test_catches_a_planted_claim(sentence):
    assert claims(f"前文。\n\n{sentence}\n"), sentence


@pytest.mark.parametrize("text", [
    "每 128×128 个权重一个 scale，256 × 8 / 128 = 16 行。",                       # products and shapes
    "最近偶数舍入的相对误差 ≤ 2^-4 = 6.25%，检查里 K≈300 时是 2.5–3%。",           # % without a speed word
    "实测是 bf16 的 {{ results/x.json rows[name~a].ratio | .2f }}×，快了。",        # rendered from a result
    "权重字节减半，带宽瓶颈下最多快 2 倍。<!-- derivation: bf16 2 bytes / fp8 1 byte per weight -->",
    "```text\n快 2 倍\n```",                                                        # code
])
def test_leaves_alone(text):
    assert not claims(text), text


def test_an_empty_marker_backs_nothing():
    assert claims("读一半的字节，kernel 就快一倍。<!-- derivation: -->\n")
