"""A tiny SVG vocabulary for the book's figures: boxes, arrows, text, laid out by hand on a grid.

Every figure is a function in a module of course/book/figures/ that returns an `Svg`; `python -m course.book.figures`
writes them to book/figures/*.svg. Text uses the system's sans-serif font (Noto Sans CJK on Debian).
"""

from __future__ import annotations

from html import escape

FONT = "Noto Sans CJK SC, Noto Sans, DejaVu Sans, sans-serif"
MONO = "DejaVu Sans Mono, Noto Sans Mono CJK SC, monospace"

# A small palette: one colour per kind of thing, the same in every figure.
COLORS = {
    "norm": "#e8f1fb", "attn": "#fdecea", "mlp": "#e9f7ef", "moe": "#fff4e0", "gdn": "#f3e8fd",
    "io": "#f2f2f2", "kv": "#e6f4f1", "free": "#ffffff", "hot": "#ffd8a8", "gpu": "#dfe7fd", "cpu": "#f7f7f7",
}
STROKE = "#333"


class Svg:
    def __init__(self, width: float, height: float, title: str):
        self.width, self.height, self.title = width, height, title
        self.items: list[str] = []

    # -- primitives
    def rect(self, x, y, w, h, fill="#fff", stroke=STROKE, rx=6, dash=False, sw=1.2):
        d = ' stroke-dasharray="5 3"' if dash else ""
        self.items.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="{sw}"{d}/>')

    def text(self, x, y, s, size=13, anchor="middle", weight="normal", color="#111", mono=False, italic=False):
        font = MONO if mono else FONT
        style = ' font-style="italic"' if italic else ""
        for i, line in enumerate(str(s).split("\n")):
            self.items.append(f'<text x="{x}" y="{y + i * size * 1.25}" font-family="{font}" font-size="{size}" '
                              f'text-anchor="{anchor}" font-weight="{weight}" fill="{color}"{style}>'
                              f'{escape(line)}</text>')

    def box(self, x, y, w, h, label, fill="#fff", size=13, mono=False, dash=False, weight="normal", rx=6):
        """A rectangle with centred (possibly multi-line) text."""
        self.rect(x, y, w, h, fill=fill, dash=dash, rx=rx)
        lines = str(label).split("\n")
        top = y + h / 2 - (len(lines) - 1) * size * 1.25 / 2 + size * 0.35
        self.text(x + w / 2, top, label, size=size, mono=mono, weight=weight)

    def line(self, points, arrow=True, color=STROKE, dash=False, sw=1.3):
        pts = " ".join(f"{x},{y}" for x, y in points)
        marker = ' marker-end="url(#arrow)"' if arrow else ""
        d = ' stroke-dasharray="5 3"' if dash else ""
        self.items.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{sw}"{d}{marker}/>')

    def arrow(self, x1, y1, x2, y2, **kw):
        self.line([(x1, y1), (x2, y2)], **kw)

    def curve(self, x1, y1, cx, cy, x2, y2, arrow=True, color=STROKE, dash=False):
        marker = ' marker-end="url(#arrow)"' if arrow else ""
        d = ' stroke-dasharray="5 3"' if dash else ""
        self.items.append(f'<path d="M{x1},{y1} Q{cx},{cy} {x2},{y2}" fill="none" stroke="{color}" '
                          f'stroke-width="1.3"{d}{marker}/>')

    def circle(self, x, y, r, label="", fill="#fff", size=13):
        self.items.append(f'<circle cx="{x}" cy="{y}" r="{r}" fill="{fill}" stroke="{STROKE}" stroke-width="1.2"/>')
        if label:
            self.text(x, y + size * 0.35, label, size=size)

    def render(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{escape(self.title)}">\n'
                f'<title>{escape(self.title)}</title>\n'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/>'
                '</marker></defs>\n'
                f'<rect width="{self.width}" height="{self.height}" fill="#fff"/>\n')
        return head + "\n".join(self.items) + "\n</svg>\n"
