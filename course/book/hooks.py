"""MkDocs hooks of the book build (course/book/build.py): typeset formulas, make <details> render Markdown.

Formulas: pymdownx.arithmatex (generic mode) wraps `$...$` and `$$...$$` in `<span|div class="arithmatex">`;
on_page_content replaces each with an SVG typeset by ziamath (pure Python, STIX Two Math outlines), so the
pages need no math JavaScript and render the same in the site and the PDF.
"""

from __future__ import annotations

import hashlib
import html
import re

from mkdocs.plugins import event_priority

_DETAILS_OPEN = re.compile(r"<details>(\s*<summary>(.*?)</summary>)", re.S)
_INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)
_BLOCK = re.compile(r'<div class="arithmatex">\\\[(.*?)\\\]</div>', re.S)
_cache: dict[tuple[str, bool], str] = {}


def _details(m: re.Match) -> str:
    """`<details markdown="1">` so the hint's Markdown is rendered. Hints L1-L3 get anchors hint-l1..l3 (an empty
    <sup>; on_post_build gives them the page prefix the print page puts on links)."""
    summary = re.sub(r"<[^>]+>", "", m.group(2)).strip()
    level = re.match(r"L([123])\b", summary)
    anchor = f'<sup id="hint-l{level.group(1)}" class="hint-anchor"></sup>\n' if level else ""
    return f'{anchor}<details markdown="1">{m.group(1)}'


_APPENDIX_H = re.compile(r"(`[^`\n]*`)|(?<!\[)附录 H-(\d+)")


def _link_appendix_h(markdown: str, src: str) -> str:
    """Every plain `附录 H-n` (outside inline code) links to that entry of appendix H."""
    import posixpath
    target = posixpath.relpath("appendix-h/index.md", posixpath.dirname(src) or ".")
    return _APPENDIX_H.sub(lambda m: m.group(1) or f"[附录 H-{m.group(2)}]({target}#h-{m.group(2)})", markdown)


_CARD_MENTION = re.compile(r"(?<!\[)`lessons/([a-z0-9_]+\.md)`")


def _link_cards(markdown: str, src: str) -> str:
    """A mention of a card, `lessons/m03_sparse_moe.md`, links to the card's page (cards are pages of the site)."""
    import posixpath
    base = posixpath.dirname(src) or "."
    return _CARD_MENTION.sub(lambda m: f"[`lessons/{m.group(1)}`]({posixpath.relpath('lessons/' + m.group(1), base)})",
                             markdown)


@event_priority(100)      # before the print-site plugin copies the page
def on_page_markdown(markdown: str, page=None, **kwargs) -> str:
    markdown = _DETAILS_OPEN.sub(_details, markdown)
    if page is not None and not page.file.src_uri.startswith("lessons/"):
        markdown = _link_cards(markdown, page.file.src_uri)
    if page is not None and not page.file.src_uri.startswith("appendix-h/"):
        markdown = _link_appendix_h(markdown, page.file.src_uri)
    return markdown


_CJK = re.compile(r"[\u3000-\u9fff\uff00-\uffef]")


def typeset(tex: str, display: bool) -> str:
    key = (tex, display)
    if _CJK.search(tex):        # the math font has no CJK glyphs: they would print as empty boxes
        raise ValueError(f"公式里不能有中文（数学字体没有中文字形），把说明移到公式外：{tex!r}")
    if key not in _cache:
        import ziamath
        math = ziamath.Latex(tex, size=17 if display else 15.5, mathstyle="display" if display else "text")
        svg = math.svg()
        vb = [float(v) for v in re.search(r'viewBox="([^"]+)"', svg).group(1).split()]
        below = vb[1] + vb[3]            # the baseline is y = 0 in the viewBox
        label = html.escape(tex, quote=True)
        # Unique glyph ids per formula: several SVGs inline in one page must not share <symbol> ids.
        tag = hashlib.sha1(tex.encode()).hexdigest()[:8]
        svg = re.sub(r'(id="|href="#)([^"]+)"', lambda g: f'{g.group(1)}{g.group(2)}-{tag}"', svg)
        svg = svg.replace("<svg ", f'<svg role="img" aria-label="{label}" ', 1)
        if display:
            _cache[key] = f'<div class="math math-display">{svg}</div>'
        else:
            _cache[key] = (f'<span class="math math-inline" style="vertical-align:{-below:.2f}px">'
                           f'{svg}</span>')
    return _cache[key]


@event_priority(100)      # before the print-site plugin copies the page
def on_page_content(content: str, **kwargs) -> str:
    content = _BLOCK.sub(lambda m: typeset(html.unescape(m.group(1)).strip(), True), content)
    return _INLINE.sub(lambda m: typeset(html.unescape(m.group(1)).strip(), False), content)


_SECTION = re.compile(r'<section class="print-page" id="([^"]+)"')


@event_priority(-200)     # after the print-site plugin has written the print page
def on_post_build(config, **kwargs) -> None:
    """In the print page, prefix the hint anchors with their page's key, as print-site does for headings
    (it rewrites the links to `#<page>-hint-l1` but only the ids of h1-h6, sup and li that start a tag match)."""
    from pathlib import Path
    path = Path(config["site_dir"]) / "print_page.html"
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    cuts = [(m.start(), m.group(1)) for m in _SECTION.finditer(text)]
    out, last = [], 0
    for (start, key), end in zip(cuts, [c[0] for c in cuts[1:]] + [len(text)]):
        out.append(text[last:start])
        out.append(text[start:end].replace('<sup id="hint-l', f'<sup id="{key}-hint-l'))
        last = end
    out.append(text[last:])
    path.write_text("".join(out), encoding="utf-8")
