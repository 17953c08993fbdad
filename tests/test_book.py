"""The book: derived files are current, citations are self-contained, and the built site and PDF hold up
in a real browser (headless Chromium opens every page from 127.0.0.1)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

import pytest

from course.book import build as bookbuild, figures
from course.grader import registry

ROOT = registry.ROOT
SCREENSHOTS = bookbuild.BUILD / "screenshots"
# Documents the learner does not have; learner-facing text must not cite them.
FOREIGN = re.compile(r"HF 笔记|COURSE_DESIGN|课程设计|种子文档|shared/reference|\.\./shared")


# ---------------------------------------------------------------- fast checks (no browser)

def test_figures_are_generated_from_course_figures():
    for name, text in figures.render_all().items():
        path = ROOT / "book" / "figures" / f"{name}.svg"
        assert path.is_file() and path.read_text(encoding="utf-8") == text, \
            f"{path.relative_to(ROOT)} is stale: run python -m course.book.figures"


def test_every_figure_is_used_in_the_book():
    text = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "book").rglob("*.md"))
    unused = [n for n in figures.FIGURES if f"figures/{n}.svg" not in text]
    assert not unused, f"figures no page shows: {unused}"


def test_no_citation_of_documents_learners_do_not_have():
    hits = []
    for folder in ("lessons", "book", "checks", "mine", "solutions"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".md", ".py") and path.is_file():
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if FOREIGN.search(line):
                        hits.append(f"{path.relative_to(ROOT)}:{n}")
    assert not hits, f"cites a document outside the repo: {hits}"


def test_nav_lists_every_summary_page_and_the_cards():
    summary = (ROOT / "book" / "SUMMARY.md").read_text(encoding="utf-8")
    pages = {p for _, p in bookbuild.nav_pages(bookbuild.summary_nav())}
    for target in re.findall(r"\]\(([^)#]+\.md)\)", summary):
        assert target in pages, target
    for ex in registry.written():
        assert f"lessons/{ex.card.name}" in pages
        assert f"appendix-a/a-{ex.number}.md" in pages and f"appendix-c/c-{ex.number}.md" in pages


def test_card_titles_in_the_nav_name_their_exercise():
    # The PDF's table of contents lists the cards by these titles: a prefix several cards share ("Triton") names none
    titles = [t for t, p in bookbuild.nav_pages(bookbuild.summary_nav()) if p.startswith("lessons/")]
    names = [t.split(" · ", 1)[1] for t in titles]
    assert len(set(names)) == len(names), titles
    assert bookbuild.card_title(registry.get("k03"), registry.CATALOGUE) == "fused MoE"


def test_card_header_page_cites():
    text = "# #3 · Track M · 模型实现 · 书 §M.3\n\n## M03 · x\n"
    assert bookbuild.cite_pages(text, {"§M.3": 27}).startswith("# #3 · Track M · 模型实现 · 书 §M.3 · p.27\n")
    again = bookbuild.cite_pages(bookbuild.cite_pages(text, {"§M.3": 27}), {"§M.3": 31})
    assert again.startswith("# #3 · Track M · 模型实现 · 书 §M.3 · p.31\n")
    for ex in registry.written():
        first = ex.card.read_text(encoding="utf-8").splitlines()[0]
        assert re.fullmatch(rf"# #{ex.number} · Track {ex.track} · .+ · 书 {re.escape(ex.book_section)} · p\.\d+",
                            first), f"{ex.card.name}: header without a page cite (run ./check.sh book): {first}"


def test_links_into_the_staged_layout():
    page = ROOT / "book" / "appendix-a" / "a-3.md"
    text = "[卡片](../../lessons/m03_sparse_moe.md#hint-l2) [C-3](../appendix-c/c-3.md)"
    assert bookbuild._relink(text, page, "appendix-a/a-3.md") == \
        "[卡片](../lessons/m03_sparse_moe.md#hint-l2) [C-3](../appendix-c/c-3.md)"


def test_build_without_the_cjk_font_stops_before_touching_the_repo(monkeypatch, capsys):
    """No fonts-noto-cjk: every Chinese character would print as a box and every page cite would be wrong. The
    build stops first, changes no file, and names the Debian packages (not .venv, which is fine)."""
    import importlib.util
    monkeypatch.setattr(bookbuild, "_font", lambda lang: lang != "zh")
    monkeypatch.setattr(bookbuild, "chromium", lambda: "/usr/bin/chromium")
    monkeypatch.setattr(bookbuild.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    before = {p: p.read_bytes() for p in [*(ROOT / "lessons").glob("*.md"), *(ROOT / "book").rglob("*.md")]}
    assert bookbuild.build(write=True) == 2
    assert all(p.read_bytes() == text for p, text in before.items())
    hint = capsys.readouterr().err
    assert "apt: fonts-noto-cjk" in hint and "apt-get update" in hint, hint
    assert all(pkg in hint for pkg in bookbuild.APT_PACKAGES) and ".venv" not in hint, hint


# ---------------------------------------------------------------- the built book in a real browser

def _tools_or_skip() -> None:
    missing = bookbuild.missing_tools()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have the book's tools (.ci/run installs them): {missing}")
        pytest.skip(f"需要 {', '.join(missing)}（./check.sh book 的工具）")


@pytest.fixture(scope="module")
def built():
    _tools_or_skip()
    assert bookbuild.build(write=False) == 0
    import json
    return json.loads(bookbuild.PAGES.read_text(encoding="utf-8"))


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def test_internal_links_resolve(built):
    site = bookbuild.SITE
    parsed: dict[Path, _Links] = {}

    def links_of(path: Path) -> _Links:
        if path not in parsed:
            parsed[path] = _parse(path)
        return parsed[path]

    broken = []
    for page in site.rglob("*.html"):
        links = links_of(page)
        for href in links.hrefs:
            url = urlparse(href)
            if url.scheme or href.startswith(("mailto:", "//")):
                continue
            target, frag = urldefrag(href)
            base = site if target.startswith("/") else page.parent    # root-relative: the server's root
            dest = (base / unquote(target).lstrip("/")).resolve() if target else page
            if dest.is_dir():
                dest = dest / "index.html"
            if not dest.exists():
                broken.append(f"{page.relative_to(site)} -> {href}")
            elif frag and dest.suffix == ".html":
                ids = links_of(dest).ids
                if unquote(frag) not in ids:
                    broken.append(f"{page.relative_to(site)} -> {href} (no id {frag})")
    assert not broken, f"broken links: {broken[:20]}"


def test_no_link_from_the_server_root(built):
    # a link starting with "/" works only when the site sits at the server's root (404.html is written that way by
    # MkDocs without a site_url; build.relative_404 rewrites it)
    rooted = re.compile(r'\b(?:href|src|action)="/(?!/)')
    bad = [p.relative_to(bookbuild.SITE).as_posix() for p in bookbuild.SITE.rglob("*.html")
           if rooted.search(p.read_text(encoding="utf-8"))]
    assert not bad, f"root-absolute links in {bad[:10]}"


_RAW = [(re.compile(r"\$\$|\\\(|\\\[|\\frac|\\sum|\\mathrm|\\begin\{"), "raw TeX"),
        (re.compile(r"^\s*(graph (TD|LR)|flowchart |sequenceDiagram|stateDiagram)", re.M), "raw Mermaid")]

# In the page: visible text outside code blocks (code may legitimately show `$` or `\sum`).
_VISIBLE_TEXT = """() => {
  const root = document.querySelector('article') || document.body;
  const clone = root.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, svg').forEach(e => e.remove());
  return clone.innerText;
}"""


def test_every_page_renders_offline_in_chromium(built):
    from playwright.sync_api import Error as PlaywrightError

    pages = sorted(p.relative_to(bookbuild.SITE).as_posix() for p in bookbuild.SITE.rglob("*.html")
                   if not p.name.startswith("404"))
    problems: list[str] = []
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    SCREENSHOTS.mkdir(parents=True)
    # page -> (screenshot name, element scrolled into view first)
    shots = {"track-m/m05-gated-deltanet.html": ("chapter-with-formulas", ".math-display"),
             "prerequisites.html": ("prerequisites-formulas", ".math-display"),
             "track-e/e02-block-manager.html": ("chapter-with-figures", "img[src$='.svg']"),
             "overview.html": ("overview-figure", "img[src$='.svg']"),
             "lessons/m03_sparse_moe.html": ("card", None), "index.html": ("home", None)}
    with bookbuild.serve() as base, bookbuild.browser() as b:
        origin = base.rstrip("/")
        ctx = b.new_context(viewport={"width": 1280, "height": 900})
        page = ctx.new_page()
        current = {"url": ""}
        page.on("console", lambda m: m.type == "error" and problems.append(f"{current['url']}: console error {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"{current['url']}: page error {e}"))

        def on_request(req):
            if not req.url.startswith((origin, "data:", "blob:", "about:")):
                problems.append(f"{current['url']}: request leaves the machine: {req.url}")
        page.on("request", on_request)
        page.on("response", lambda r: r.status >= 400 and problems.append(f"{current['url']}: {r.status} {r.url}"))
        # ERR_ABORTED: the browser cancelled the request itself (e.g. the favicon when we navigate on) - not a
        # missing file (that is a 404 response, checked below) nor an outside request (checked by host)
        page.on("requestfailed", lambda r: r.url.startswith(origin) and "ERR_ABORTED" not in (r.failure or "") and
                problems.append(f"{current['url']}: failed {r.url} {r.failure}"))
        for rel in pages:
            current["url"] = rel
            try:
                page.goto(f"{base}{rel}", wait_until="load", timeout=60_000)
            except PlaywrightError as exc:
                problems.append(f"{rel}: {exc}")
                continue
            text = page.evaluate(_VISIBLE_TEXT)
            for pattern, what in _RAW:
                if m := pattern.search(text):
                    problems.append(f"{rel}: {what} left unrendered: {text[max(0, m.start() - 30):m.end() + 30]!r}")
            code = page.evaluate("() => [...document.querySelectorAll('pre, .mermaid')]"
                                 ".filter(e => !e.querySelector('svg')).map(e => e.innerText).join('\\n')")
            if m := _RAW[1][0].search(code):
                problems.append(f"{rel}: Mermaid source shown as text ({m.group(0).strip()!r}); draw figures in "
                                "course/book/figures")
            broken_imgs = page.evaluate("() => [...document.images].filter(i => !i.complete || "
                                        "i.naturalWidth === 0).map(i => i.src)")
            problems.extend(f"{rel}: image not rendered {src}" for src in broken_imgs)
            if rel in shots:
                name, selector = shots[rel]
                if selector:
                    page.locator(selector).first.scroll_into_view_if_needed()
                page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=False)
        ctx.close()
    assert len(pages) >= len(built["nav"]), (len(pages), len(built["nav"]))
    assert not problems, "\n".join(problems[:30])
    saved = {p.stem for p in SCREENSHOTS.glob("*.png")}
    assert saved == {name for name, _ in shots.values()}, f"screenshots missing: {saved}"


def _search(page, base: str, query: str) -> tuple[int, list[str]]:
    """Enter `query` into the site's search box: (number of pages found, titles of the first results), read once
    the results stop changing."""
    page.goto(f"{base}index.html", wait_until="load")
    meta_js = "document.querySelector('.md-search-result__meta')?.innerText || ''"
    page.wait_for_function(f"() => ({meta_js}).includes('键入以开始搜索')", timeout=60_000)   # the index is ready
    page.click("input.md-search__input")
    page.fill("input.md-search__input", query)
    page.keyboard.press("End")                  # the search box reacts to keys, not to a pasted value alone
    page.wait_for_function(f"() => /\\d+ 个符合条件的结果|没有找到/.test({meta_js})", timeout=30_000)
    seen, same = None, 0
    for _ in range(100):
        page.wait_for_timeout(300)
        now = (page.evaluate(meta_js), page.locator(".md-search-result__item > a h1").all_inner_texts())
        same = same + 1 if now == seen else 0
        seen = now
        if same == 3:
            break
    meta, titles = seen
    found = re.search(r"(\d+) 个符合条件的结果", meta)
    return (int(found.group(1)) if found else 0), [t.replace("\u200b", "") for t in titles]


def test_search_finds_inflected_english_and_chinese(built):
    """English words are found in any inflection (the index holds stems, the query is stemmed too), and a Chinese
    phrase finds the pages about it first."""
    with bookbuild.serve() as base, bookbuild.browser() as b:
        page = b.new_page(viewport={"width": 1280, "height": 900})
        n_kernel, _ = _search(page, base, "kernel")
        n_kernels, titles = _search(page, base, "kernels")
        assert n_kernel >= 30 and n_kernels >= 0.9 * n_kernel, (n_kernel, n_kernels)
        assert any(t.startswith("§K.4") for t in titles[:6]), titles[:6]
        n_paged, titles = _search(page, base, "paged")
        assert n_paged >= 20 and any("Paged KV cache" in t for t in titles[:6]), (n_paged, titles[:6])
        n, titles = _search(page, base, "引用计数")
        assert n >= 2 and any(t.startswith("§E.2") for t in titles[:3]), (n, titles[:3])
        n, titles = _search(page, base, "抢占")
        assert n >= 2 and any(t.startswith("§E.3") for t in titles[:3]), (n, titles[:3])


def test_pdf_build_fails_on_content_wider_than_the_page(built):
    """The print page as built passes the layout check; a table wider than the page makes it fail, naming it."""
    with bookbuild.serve() as base, bookbuild.browser() as b:
        page = b.new_page()
        page.goto(f"{base}{bookbuild.PRINT_PAGE}", wait_until="load")
        page.emulate_media(media="print")
        page.add_style_tag(content=bookbuild._PAGE_CSS)
        bookbuild.check_layout(page)
        page.evaluate("""() => {
          const sec = document.querySelectorAll('#print-site-page section.print-page')[3];
          // words no line break can split (long identifiers), eight of them side by side
          const cells = Array.from({length: 8}, (_, i) => `<td>wide_cell_${i}_${'x'.repeat(40)}</td>`);
          sec.insertAdjacentHTML('beforeend', '<div class="md-typeset__scrollwrap"><div class="md-typeset__table">'
            + '<table><tr>' + cells.join('') + '</tr></table></div></div>');
        }""")
        with pytest.raises(bookbuild.LayoutError, match="wide_cell_0"):
            bookbuild.check_layout(page)


def _pdftotext(first: int, last: int, mode: str = "-layout") -> str:
    return subprocess.run(["pdftotext", mode, "-f", str(first), "-l", str(last), str(bookbuild.PDF), "-"],
                          capture_output=True, text=True, check=True).stdout


def _squash(s: str) -> str:
    """Text compared as letters and digits only: pdftotext's word order and spacing depend on the fonts (a full-width
    colon may come out after the word that follows it, a wrapped TOC entry gets its page number in the middle), so
    whitespace, punctuation and the bare numbers of page-number columns are dropped before comparing."""
    s = re.sub(r"(?<!\S)\d{1,3}(?!\S)", " ", s)
    return re.sub(r"[\W_]+", "", s)


def test_pdf_has_toc_page_numbers_and_outline(built):
    from pypdf import PdfReader
    reader = PdfReader(str(bookbuild.PDF))
    assert len(reader.pages) == built["pages"] >= 100, len(reader.pages)
    chapters = [c for c in built["chapters"] if c["title"] and c["title"] != "目录"]
    assert all(c["page"] for c in chapters), [c for c in chapters if not c["page"]]
    # the pages before the first chapter, in drawing order (-raw): -layout sorts words by position, and a CJK word's
    # taller box can land on the line above ("g01 · GPU 总装" came out as "总装" over "g01 · GPU"; a wrapped heading too)
    toc = _squash(_pdftotext(1, min(c["page"] for c in chapters) - 1, "-raw"))
    missing = [title for title, _ in built["nav"] if _squash(title) not in toc]
    assert not missing, f"chapters missing from the printed TOC: {missing}"
    outline = [item.title for item in reader.outline for item in (item if isinstance(item, list) else [item])]
    lost = [c["title"] for c in chapters if c["title"] not in outline]
    assert not lost, f"chapters missing from the PDF bookmarks: {lost}"
    # every TOC entry names the page the chapter starts on
    for c in chapters:
        assert _squash(c["title"]) in _squash(_pdftotext(c["page"], c["page"], "-raw")), (c["title"], c["page"])


def test_card_headers_cite_the_pages_of_their_chapters(built):
    chapters = {m.group(1): c for c in built["chapters"] if (m := re.match(r"(§[A-Z]\.\d+)\s", c["title"]))}
    stale = []
    for ex in registry.written():
        first = ex.card.read_text(encoding="utf-8").splitlines()[0]
        cited = int(re.search(r"p\.(\d+)$", first).group(1))
        chapter = chapters[ex.book_section]
        if cited != chapter["page"]:
            stale.append(f"{ex.card.name}: cites p.{cited}, the PDF has {ex.book_section} on p.{chapter['page']}")
            continue
        assert _squash(chapter["title"]) in _squash(_pdftotext(cited, cited)), (ex.id, cited)
    assert not stale, "stale page cites (run ./check.sh book and commit the cards): " + "; ".join(stale)


def test_tools_are_not_on_the_ready_line():
    ready = (ROOT / "check.sh").read_text(encoding="utf-8").split("READY='", 1)[1].split("'", 1)[0]
    assert not any(m in ready for m in ("mkdocs", "playwright", "ziamath", "pypdf")), ready
