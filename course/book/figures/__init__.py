"""The book's figures, generated as SVG text: `python -m course.book.figures` writes book/figures/*.svg.

Each module holds the figures of one topic; FIGURES maps a file name to the function drawing it. The book
build regenerates them, and tests/test_book.py checks the committed SVGs are up to date.
"""

from __future__ import annotations

from pathlib import Path

from . import engine, kernels, models

FIGURES = {**models.FIGURES, **engine.FIGURES, **kernels.FIGURES}


def render_all() -> dict[str, str]:
    return {name: fn().render() for name, fn in FIGURES.items()}


def write_all(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in render_all().items():
        path = folder / f"{name}.svg"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        out.append(path)
    return out
