"""Appendix A of the book is derived from the cards: `python -m course.book` rewrites book/appendix-a/a-N.md.

The card's `<details>` hint blocks are the single source; a selftest checks the appendix is up to date.
"""

from __future__ import annotations

from . import cards, registry


def hint_page(ex: registry.Exercise) -> str:
    parts = [f"# {ex.hint_ref} · {ex.title} 的三级提示\n",
             f"> 练习 {ex.id}（{ex.book_section}）。命令行：`./check.sh hint {ex.id} --level 1|2|3`。"
             f"本页由 `python -m course.book` 从卡片 `lessons/{ex.card.name}` 生成，请改卡片而不是本页。\n"]
    for level in (1, 2, 3):
        summary, body = cards.hint(ex, level).split("\n", 1)
        parts.append(f"## {summary.strip('* ')}\n\n{body.strip()}\n")
    return "\n".join(parts)


def hint_path(ex: registry.Exercise):
    return registry.ROOT / "book" / "appendix-a" / f"a-{ex.number}.md"


def main() -> None:
    for ex in registry.written():
        hint_path(ex).write_text(hint_page(ex), encoding="utf-8")
        print(f"wrote {hint_path(ex).relative_to(registry.ROOT)}")


if __name__ == "__main__":
    main()
