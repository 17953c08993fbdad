"""The card's 验收要点 line names exactly the checks of its exercise (the @point titles)."""

import re

import pytest

from course.grader import cards, registry

WRITTEN = registry.written()


def _points(ex) -> list[str]:
    text = ex.checks.read_text(encoding="utf-8")
    return re.findall(r'@point\("([^"]+)"\)', text)


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_card_lists_every_check(ex):
    card = cards.text(ex)
    line = next((l for l in card.splitlines() if "验收要点" in l and "：" in l), "")
    missing = [p for p in _points(ex) if p not in line]
    assert line and not missing, f"{ex.card.name}: the 验收要点 line does not name these checks: {missing}"
