"""The slot of the samples that set their own pace (step 0 of ``grouped``, docs/PACKING.md §3.7).

A sample whose language cost passes the level by ``grouped.HEAVY`` (causal attention alone adds up
to half a level near the cap) sets its slot's language pace wherever it goes, and a bin of short
samples under the same token cap cannot match it: only long samples lift a bin towards it (a bin's
attention term grows with its longest sample). :func:`heavy_slot` gives such samples a slot of
their own and fills its other bins with the longest samples of the mini-batch, of any image group
within a tower budget, so that the slot's ranks wait less for the heavy one. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer_lib.planning.items import MiniBatchItems

__all__ = ["HEAVY_SLOT_VISION", "heavy_slot"]

HEAVY_SLOT_VISION = 0.5
"""A bin of the heavy slot takes a sample of an image set it does not hold while its images then
cost at most this share of the costliest group's (or the heavy bins' own, if more): on
``bench/pack.py``'s mix 0.35-0.7 gave the same FLOP idle, 0 and 0.25 more, no limit much more
(the extra encodes of many groups)."""


def heavy_slot(
    section: Sequence[int], heavy: Sequence[int], items: MiniBatchItems
) -> tuple[list[tuple[int, list[int]]], set[int]]:
    """One slot of ``items.dp`` bins: the ``heavy`` samples (1 to ``dp`` of ``section``, costliest
    first) one per bin, then the other samples of ``section``, largest language cost first, each
    into the bin with the least language cost that has room for it (``cap`` tokens; ``cap -
    reserve`` in a bin without images: the synthetic pad's room) without passing the first heavy
    sample's cost, a new image set (``items.image_sets``) only within the tower budget
    (:data:`HEAVY_SLOT_VISION`).

    Arguments as :func:`~trainer_lib.planning.grouped.grouped_vision_slots`.

    Returns:
        The slot's ``(tokens, sample indices)`` bins, and the samples it holds.
    """
    lengths, groups, language, vision = items.lengths, items.image_sets, items.language, items.vision
    cap, reserve, dp = items.cap, items.reserve, items.dp
    cost = {groups[i]: vision[i] for i in section if groups[i] is not None}
    load = [language[i] for i in heavy] + [0.0] * (dp - len(heavy))
    tokens = [lengths[i] for i in heavy] + [0] * (dp - len(heavy))
    held = [{groups[i]} - {None} for i in heavy] + [set() for _ in range(dp - len(heavy))]
    bins = [[i] for i in heavy] + [[] for _ in range(dp - len(heavy))]
    images = [sum(cost[g] for g in h) for h in held]
    ceiling = max(max(images), HEAVY_SLOT_VISION * max(cost.values(), default=0.0))
    pace, taken = language[heavy[0]], set(heavy)
    lightest, emptiest = min(load), min(tokens)
    for i in sorted((i for i in section if i not in taken), key=lambda i: -language[i]):
        if lightest + language[i] > pace or emptiest + lengths[i] > cap:  # joins no bin
            continue
        g, best = groups[i], -1
        for j in range(dp):
            room = cap if g is not None or held[j] else cap - reserve
            if (
                tokens[j] + lengths[i] <= room
                and load[j] + language[i] <= pace
                and (g is None or g in held[j] or images[j] + cost[g] <= ceiling)
                and (best < 0 or load[j] < load[best])
            ):
                best = j
        if best >= 0:
            if g is not None and g not in held[best]:
                held[best].add(g)
                images[best] += cost[g]
            bins[best].append(i)
            load[best] += language[i]
            tokens[best] += lengths[i]
            taken.add(i)
            lightest, emptiest = min(load), min(tokens)
    return [(tokens[j], sorted(bins[j])) for j in range(dp)], taken
