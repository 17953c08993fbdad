"""Appendix A of the book is derived from the cards: `python -m course.book` rewrites book/appendix-a/a-N.md.

The card's `<details>` hint blocks are the single source. A-N does not copy them: it links to each level in the
card (the book build gives the blocks the anchors hint-l1..hint-l3, and hint-lN-2... to a level's later blocks). A selftest checks the appendix is current.
"""

from __future__ import annotations

from ..grader import cards, registry


def hint_page(ex: registry.Exercise) -> str:
    card = f"../../lessons/{ex.card.name}"
    parts = [f"# {ex.hint_ref} · {ex.title} 的三级提示\n",
             f"练习 {ex.id}（{ex.book_section}）的三级提示折叠在卡片 [`lessons/{ex.card.name}`]({card}) 的“三级提示”一节里，"
             f"一级比一级剧透得多；卡住十分钟以上再往下翻一级。命令行里一次只看一级："
             f"`./check.sh hint {ex.id} --level 1|2|3`。\n"]
    for level in (1, 2, 3):
        blocks = [summary for summary in cards.hint_summaries(ex) if cards.level_of(summary) == level]
        for k, summary in enumerate(blocks):
            parts.append(f"- [{summary}]({card}#{cards.hint_anchor(level, k)})")
    parts.append(f"\n参考解的逐段讲解见 [附录 {ex.solution_ref}](../appendix-c/c-{ex.number}.md)。\n\n"
                 f"<!-- 本页由 `python -m course.book` 从卡片生成，请改卡片而不是本页。 -->")
    return "\n".join(parts) + "\n"


def hint_path(ex: registry.Exercise):
    return registry.ROOT / "book" / "appendix-a" / f"a-{ex.number}.md"


def main() -> None:
    for ex in registry.written():
        hint_path(ex).write_text(hint_page(ex), encoding="utf-8")
        print(f"wrote {hint_path(ex).relative_to(registry.ROOT)}")

