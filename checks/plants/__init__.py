"""Planted mistakes: each 易错点 of a card as an exact text edit of the reference (see CONTRIBUTING.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


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
