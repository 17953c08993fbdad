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


def hint_anchor(level: int, k: int) -> str:
    """The id of the k-th (from 0) `<details>` block of hint level `level` on a card: hint-l2, then hint-l2-2, ...
    (the same format as course.grader.cards.hint_anchor: mkdocs loads this file on its own)."""
    return f"hint-l{level}" if k == 0 else f"hint-l{level}-{k + 1}"


def _details_sub(markdown: str) -> str:
    """`<details markdown="1">` so the hint's Markdown is rendered. Hint blocks get anchors (hint_anchor; an empty
    <sup>; on_post_build gives them the page prefix the print page puts on links)."""
    seen: dict[str, int] = {}

    def one(m: re.Match) -> str:
        summary = re.sub(r"<[^>]+>", "", m.group(2)).strip()
        level = re.match(r"L([123])\b", summary)
        anchor = ""
        if level:
            k = seen[level.group(1)] = seen.get(level.group(1), -1) + 1
            anchor = f'<sup id="{hint_anchor(int(level.group(1)), k)}" class="hint-anchor"></sup>\n'
        return f'{anchor}<details markdown="1">{m.group(1)}'

    return _DETAILS_OPEN.sub(one, markdown)


# A cross-reference in running text: `附录 A-3` / `附录 C-3` / `附录 H-2`, or a chapter `§M.3` (with the card header's
# ` · p.27` when it follows). Inline code and existing links are matched first and left as they are.
_REF = re.compile(r"(`[^`\n]*`|!?\[[^\]\n]*\]\([^)\n]*\))|附录 ([ACH])-(\d+)|(§([A-Z])\.(\d+)(?: · p\.\d+)?)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def chapter_paths(nav) -> dict[str, str]:
    """"§M.3" -> the page of the chapter whose nav title starts with it (from the MkDocs nav)."""
    out: dict[str, str] = {}
    for item in nav or []:
        for title, value in (item.items() if isinstance(item, dict) else []):
            if isinstance(value, list):
                out.update(chapter_paths(value))
            elif m := re.match(r"(§[A-Z]\.\d+)\s", str(title)):
                out[m.group(1)] = value
    return out


def _link_refs(markdown: str, src: str, chapters: dict[str, str], exists) -> str:
    """Every plain cross-reference (outside code and links) becomes a link to its page; none to the page itself."""
    import posixpath
    base = posixpath.dirname(src) or "."

    def link(text: str, path: str, anchor: str = "") -> str:
        if path == src or not exists(path):
            return text
        return f"[{text}]({posixpath.relpath(path, base)}{anchor})"

    def fix(m: re.Match) -> str:
        if m.group(1):
            return m.group(1)
        if m.group(2):
            kind, n = m.group(2), m.group(3)
            if kind == "H":
                return link(f"附录 H-{n}", "appendix-h/index.md", f"#h-{n}")
            return link(f"附录 {kind}-{n}", f"appendix-{kind.lower()}/{kind.lower()}-{n}.md")
        path = chapters.get(f"§{m.group(5)}.{m.group(6)}")
        return link(m.group(4), path) if path else m.group(4)

    out, fenced = [], None
    for line in markdown.split("\n"):
        if f := _FENCE.match(line):
            fenced = None if fenced == f.group(1) else (fenced or f.group(1))
            out.append(line)
        else:
            out.append(line if fenced else _REF.sub(fix, line))
    return "\n".join(out)


_CARD_MENTION = re.compile(r"(?<!\[)`lessons/([a-z0-9_]+\.md)`")


def _link_cards(markdown: str, src: str) -> str:
    """A mention of a card, `lessons/m03_sparse_moe.md`, links to the card's page (cards are pages of the site)."""
    import posixpath
    base = posixpath.dirname(src) or "."
    return _CARD_MENTION.sub(lambda m: f"[`lessons/{m.group(1)}`]({posixpath.relpath('lessons/' + m.group(1), base)})",
                             markdown)


@event_priority(100)      # before the print-site plugin copies the page
def on_page_markdown(markdown: str, page=None, config=None, files=None, **kwargs) -> str:
    markdown = _details_sub(markdown)
    if page is not None and not page.file.src_uri.startswith("lessons/"):
        markdown = _link_cards(markdown, page.file.src_uri)
    if page is not None and config is not None and files is not None:
        markdown = _link_refs(markdown, page.file.src_uri, chapter_paths(config["nav"]),
                              lambda path: files.get_file_from_path(path) is not None)
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


_FIGURE = re.compile(r'<img alt="([^"]*)" src="([^"]*figures/[\w-]+\.svg)"\s*/?>')
_FIGURE_LINK = re.compile(r'<a href="([^"#]+\.md)">')


def _inline_linked_figures(content: str, src: str, docs_dir: str) -> str:
    """A figure whose boxes link to chapters (course/book/figures: `box(..., href=)`) is drawn inline, its links
    made relative to the page, so a reader can click them (links inside an <img> are dead). print-site then
    rewrites them like every other link of the print page."""
    import posixpath
    from pathlib import Path
    base = posixpath.dirname(src) or "."

    def inline(m: re.Match) -> str:
        svg = (Path(docs_dir) / posixpath.normpath(posixpath.join(base, m.group(2)))).read_text(encoding="utf-8")
        if "<a href=" not in svg:
            return m.group(0)
        svg = _FIGURE_LINK.sub(lambda a: f'<a href="{posixpath.relpath(a.group(1), base)[:-3]}.html">', svg)
        return f'<span class="figure-inline">{svg}</span>'
    return _FIGURE.sub(inline, content)


@event_priority(100)      # before the print-site plugin copies the page
def on_page_content(content: str, page=None, config=None, **kwargs) -> str:
    content = _BLOCK.sub(lambda m: typeset(html.unescape(m.group(1)).strip(), True), content)
    content = _INLINE.sub(lambda m: typeset(html.unescape(m.group(1)).strip(), False), content)
    if page is not None and config is not None:
        content = _inline_linked_figures(content, page.file.src_uri, config["docs_dir"])
    return content


_SECTION = re.compile(r'<section class="print-page" id="([^"]+)"')

# The search worker of mkdocs-material (pinned in pyproject.toml) turns every query word into a prefix query,
# `paged*`, and Lunr runs no stemmer on a prefix query: with the index stemmed ("paged" -> "page"), `paged*` found
# almost nothing. Each English word also goes in as itself, which the stemmer then reduces like the index. A run
# of Chinese is cut into the index's words (Material's segmenter) and every word is required, not any one.
_QUERY_WILDCARD = re.compile(r"\.map\((\w)=>/\(\^\[\+-\]\|\[~\^\]\\d\+\$\)/\.test\(\1\)\?\1:`\$\{\1\}\*`\)")
_HAN_SEGMENTS = 'this.index.invertedIndex)].join("* ")'


def _patch_search_worker(site_dir) -> None:
    from pathlib import Path
    workers = list((Path(site_dir) / "assets" / "javascripts" / "workers").glob("search.*.min.js"))
    if len(workers) != 1:
        raise RuntimeError(f"search worker not found or not unique: {workers}")
    js = workers[0].read_text(encoding="utf-8")
    if not _QUERY_WILDCARD.search(js) or js.count(_HAN_SEGMENTS) != 1:
        raise RuntimeError(f"{workers[0].name}: the query code of mkdocs-material changed; update "
                           "course/book/hooks.py (_patch_search_worker)")
    js = _QUERY_WILDCARD.sub(lambda m: ".flatMap({0}=>/(^[+-]|[~^]\\d+$)/.test({0})?[{0}]:"
                                       "/^[A-Za-z]{{3,}}$/.test({0})?[`${{{0}}}*`,{0}]:[`${{{0}}}*`])".format(m.group(1)),
                             js, count=1)
    js = js.replace(_HAN_SEGMENTS, 'this.index.invertedIndex)].map(w=>"+"+w+"*").join(" ")')
    workers[0].write_text(js, encoding="utf-8")


@event_priority(-200)     # after the print-site plugin has written the print page
def on_post_build(config, **kwargs) -> None:
    """Patch the search worker's query (above). In the print page, prefix the hint anchors with their page's key,
    as print-site does for headings (it rewrites the links to `#<page>-hint-l1` but only the ids of h1-h6, sup and
    li that start a tag match)."""
    from pathlib import Path
    _patch_search_worker(config["site_dir"])
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
