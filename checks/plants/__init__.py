"""Planted mistakes: each 易错点 of a card as an exact text edit of the reference (see CONTRIBUTING.md)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

# For each planted mistake, the check that caught it in the last full selftest (module -> plant id -> check
# name). The selftest runs that check first and stops at the failure that settles the plant, so a grading costs
# one check, not the file. Only the order depends on it: a stale or missing entry makes a grading slower, never
# changes its verdict. Rewritten by `COURSE_PLANT_CATCHERS_UPDATE=1 ./check.sh selftest -k planted`.
CATCHERS = Path(__file__).with_name("catchers.json")


@dataclass(frozen=True)
class Plant:
    id: str
    mistake: str          # the 易错点 as the card words it
    old: str              # exact text in solutions/<module>.py (must occur once)
    new: str              # the planted mistake
    expect: str | None    # fragment some failure message must contain (the mistake is named), or None
    gpu_only: bool = False  # only a check that needs CUDA can catch it (the selftest skips it without a GPU)

    def apply(self, source: str) -> str:
        count = source.count(self.old)
        if count != 1:
            raise ValueError(f"plant {self.id}: the text to replace occurs {count} times in the reference, not once")
        return source.replace(self.old, self.new)


def plants_for(module: str) -> list[Plant]:
    try:
        return list(importlib.import_module(f"checks.plants.{module}").PLANTS)
    except ModuleNotFoundError:
        return []


def catchers() -> dict[str, dict[str, str]]:
    return json.loads(CATCHERS.read_text(encoding="utf-8")) if CATCHERS.exists() else {}


def record_catchers(module: str, found: dict[str, str]) -> None:
    """Merge `found` (plant id -> the check that caught it) into catchers.json, dropping plants that are gone."""
    table = catchers()
    known = {p.id for p in plants_for(module)}
    merged = {**table.get(module, {}), **found}
    table[module] = {k: merged[k] for k in sorted(merged) if k in known}
    CATCHERS.write_text(json.dumps(dict(sorted(table.items())), indent=1, ensure_ascii=False) + "\n",
                        encoding="utf-8")
