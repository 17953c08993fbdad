"""Reading lesson cards: the hint levels (`<details>` blocks L1/L2/L3) and a terminal rendering."""

from __future__ import annotations

import re

from .registry import Exercise

_DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)
# the last bullet of every card's L2 hint: the checker's selection in the learner's own Python (course/grader/notebook.py)
SELF_TEST = ("- 在检查器之外运行（notebook 或脚本，在仓库根目录启动 Python，通常是 `.venv/bin/python`）："
             "`from course import use; impl = use(\"{id}\")` 加载你的 `mine/{module}.py`，其余练习全用参考实现"
             "（与 `./check.sh {id}` 的选择相同），前面没做完的练习就不会抛 NotImplementedError；"
             "`use(mine=[\"m01\", \"m05\"])` 让几个练习都用你的文件；改了文件后再运行这一行即可重新加载。")
CARD_SECTIONS = ("题面速览", "直觉与类比", "shape trace", "易错点", "逐步图", "三级提示", "面试官追问")


def text(exercise: Exercise) -> str:
    return exercise.card.read_text(encoding="utf-8")


def hint(exercise: Exercise, level: int) -> str:
    """The bodies of the `<details>` blocks whose summary starts with L<level>, in card order (a card may fold part of
    another section at a level too, e.g. e07's 易错点, which name the rules the learner is asked to design, at L2)."""
    found = [f"**{re.sub(r'<[^>]+>', '', summary).strip()}**\n\n{body.strip()}\n"
             for summary, body in _DETAILS.findall(text(exercise)) if _level(summary) == level]
    if not found:
        raise KeyError(f"{exercise.card.name} 没有 L{level} 提示")
    return "\n".join(found)


def hint_summaries(exercise: Exercise) -> list[str]:
    """The summaries of the card's `<details>` blocks, tags removed, in card order."""
    return [re.sub(r"<[^>]+>", "", summary).strip() for summary, _ in _DETAILS.findall(text(exercise))]


def hint_anchor(level: int, k: int) -> str:
    """The book's id of the k-th (from 0) `<details>` block of hint level `level` on a card: hint-l2, hint-l2-2, ...
    (course/book/hooks.py gives the blocks these ids; it is loaded by mkdocs on its own and repeats this format)."""
    return f"hint-l{level}" if k == 0 else f"hint-l{level}-{k + 1}"


def level_of(summary: str) -> int | None:
    return _level(summary)


def _level(summary: str) -> int | None:
    m = re.match(r"L(\d)", re.sub(r"<[^>]+>", "", summary).strip())
    return int(m.group(1)) if m else None


def for_terminal(exercise: Exercise, level: int = 0) -> str:
    """The card as plain markdown: hint blocks L1..L<level> opened, the deeper ones folded into one line
    that says how to open them (`./check.sh hint <id> --level N`); other <details> blocks opened."""

    def render(m: re.Match) -> str:
        summary, body = m.group(1).strip(), m.group(2)
        n = _level(summary)
        if n is not None and n > level:
            return (f"\n#### ▸ {summary}（已折叠）\n\n`./check.sh hint {exercise.id} --level {n}` 只看这一级，"
                    f"`./check.sh show {exercise.id} --level {n}` 展开到这一级。\n")
        return f"\n#### {summary}\n{body}"

    return _DETAILS.sub(render, text(exercise))


def self_test_line(exercise: Exercise) -> str:
    return SELF_TEST.format(id=exercise.id, module=exercise.module)


def missing_sections(exercise: Exercise) -> list[str]:
    body = text(exercise)
    return [s for s in CARD_SECTIONS if s not in body]
