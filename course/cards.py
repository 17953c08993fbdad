"""Reading lesson cards: the hint levels (`<details>` blocks L1/L2/L3) and a terminal rendering."""

from __future__ import annotations

import re

from .registry import Exercise

_DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)
CARD_SECTIONS = ("题面速览", "直觉与类比", "shape trace", "易错点", "逐步图", "三级提示", "面试官追问")


def text(exercise: Exercise) -> str:
    return exercise.card.read_text(encoding="utf-8")


def hint(exercise: Exercise, level: int) -> str:
    """The body of the `<details>` block whose summary starts with L<level>."""
    for summary, body in _DETAILS.findall(text(exercise)):
        if re.sub(r"<[^>]+>", "", summary).strip().startswith(f"L{level}"):
            return f"**{re.sub(r'<[^>]+>', '', summary).strip()}**\n\n{body.strip()}\n"
    raise KeyError(f"{exercise.card.name} 没有 L{level} 提示")


def for_terminal(exercise: Exercise) -> str:
    """The card with <details>/<summary> turned into plain markdown headings."""
    body = re.sub(r"<summary>(.*?)</summary>", lambda m: f"\n#### {m.group(1).strip()}\n", text(exercise), flags=re.S)
    return re.sub(r"</?details>", "", body)


def missing_sections(exercise: Exercise) -> list[str]:
    body = text(exercise)
    return [s for s in CARD_SECTIONS if s not in body]
