"""Where two greedy runs first part."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    step: int  # index of the first generated token that differs (or where one run stopped)
    ours: int | None  # None when our run had already stopped
    reference: int | None  # None when the reference had already stopped


def first_divergence(ours: list[int], reference: list[int]) -> Divergence | None:
    for step in range(max(len(ours), len(reference))):
        mine = ours[step] if step < len(ours) else None
        theirs = reference[step] if step < len(reference) else None
        if mine != theirs:
            return Divergence(step, mine, theirs)
    return None
