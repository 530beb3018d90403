"""Step 0 of the compute plan (``trainer_lib.planning.heavy_slot``, docs/PACKING.md §3.7): samples
that set their own language pace get a slot whose other bins take the longest samples up to it."""

from __future__ import annotations

from collections.abc import Hashable

from trainer_lib.planning import grouped
from trainer_lib.planning.bins import NEUTRAL, PIXELS
from trainer_lib.planning.heavy_slot import heavy_slot
from trainer_lib.planning.items import MiniBatchItems


def _items(lengths: list[int], groups: list[Hashable | None], **kw) -> MiniBatchItems:
    """The mini-batch with a sample's image set where it has pixels (every grouped sample here)."""
    kinds = [NEUTRAL if g is None else PIXELS for g in groups]
    items = MiniBatchItems(lengths, kinds=kinds, groups=groups, **kw)
    assert items.image_sets == groups
    return items


def _costs(lengths: list[int]) -> list[float]:
    return [n * (1 + n / 200) for n in lengths]  # causal attention: 100 tokens cost 150


def test_a_sample_above_the_level_opens_a_slot_of_long_samples():
    """A sample whose causal attention puts it above the language level opens a slot whose other
    bins take the longest samples (a text one, one of another group within the slot's image
    budget) up to its pace; the rest is planned on its own. Against steps 1-4 over every sample:
    the slots' slowest language and vision costs both fall."""
    lengths = [100, 60, 40] + [10] * 16
    groups = ["H", "A", None] + ["A"] * 8 + ["B"] * 8
    language = _costs(lengths)  # ten 10-token samples cost 105
    vision = [0.0 if g is None else 1.0 for g in groups]
    items = _items(lengths, groups, language=language, vision=vision, dp=2, cap=100, reserve=2)
    section = list(range(len(lengths)))
    new = grouped.grouped_vision_slots(section, items, num_slots=2)
    old = grouped._vision_slots(section, 2, items)
    assert new is not None and old is not None
    assert [b for _, b in new[-1]] == [[0], [1, 2]]  # the heavy slot: 100 tokens per bin

    def step(plan) -> tuple[float, float]:
        lang = sum(max(sum(language[i] for i in b) for _, b in slot) for slot in plan)
        images = sum(max(len({groups[i] for i in b} - {None}) for _, b in slot) for slot in plan)
        return lang, images

    (lang, images), (lang_old, images_old) = step(new), step(old)
    assert (lang, images) == (150 + 84, 2) and lang < lang_old and images < images_old
    assert sorted(i for slot in new for _, b in slot for i in b) == section
    assert all(t == sum(lengths[i] for i in b) <= 100 for slot in new for t, b in slot)


def test_the_heavy_slot_keeps_the_pace_and_the_pad_room():
    """Each bin is filled up to the first heavy sample's cost, not past it (a second heavy bin
    tops up to it too), least-loaded bin first; a bin without images keeps ``reserve`` tokens
    for the synthetic pad."""
    lengths = [100, 90, 20, 20] + [10] * 12
    groups = ["H", "I", "A", "A"] + [None] * 12
    language = [150.0, 130.0, 100.0, 100.0] + [10.0] * 12
    vision = [1.0, 1.0, 1.0, 1.0] + [0.0] * 12
    kw = dict(lengths=lengths, groups=groups, language=language, vision=vision, cap=100, reserve=6, dp=3)
    slot, taken = heavy_slot(range(16), [0, 1], _items(**kw))
    loads = [sum(language[i] for i in b) for _, b in slot]
    assert loads == [150, 140, 150] and 3 not in taken  # the second 100 would pass the pace
    assert taken == {i for _, b in slot for i in b}
    few = dict(kw, lengths=[100, 80, 20, 10, 10, 10], groups=["H", "I", "A"] + [None] * 3)
    few.update(language=[150.0, 130.0, 100.0, 10.0, 10.0, 10.0], vision=[1.0] * 3 + [0.0] * 3)
    slot, _ = heavy_slot(range(6), [0, 1], _items(**few))
    assert slot == [(100, [0]), (80, [1]), (50, [2, 3, 4, 5])]  # the least loaded first: 130, 130

    lengths, language = [90, 93, 8], [100.0, 120.0, 8.0]  # a text sample near the cap, alone
    kw.update(lengths=lengths, groups=[None, "P", None], language=language, vision=[0.0, 1.0, 0.0], dp=2)
    slot, taken = heavy_slot(range(3), [1, 0], _items(**kw))
    assert slot == [(93, [1]), (90, [0])]  # 98 tokens would leave no room for the pad (94 at most)


def test_the_heavy_slot_encodes_a_new_image_set_only_within_its_budget():
    """A bin takes a sample of an image set it does not hold only while its images cost at most
    half the costliest group's: the longest sample of a costly group (10) stays out, one of a
    group costing 3 (above the heavy bin's own 1) joins with its group."""
    lengths = [100, 60, 50] + [10] * 8
    groups = ["H", "X", "A"] + ["X"] * 4 + ["A"] * 4
    cost = {"H": 1.0, "X": 10.0, "A": 3.0}
    kw = dict(lengths=lengths, groups=groups, language=_costs(lengths), cap=100, reserve=2, dp=2)
    slot, taken = heavy_slot(range(11), [0], _items(vision=[cost[g] for g in groups], **kw))
    assert slot == [(100, [0]), (90, [2, 7, 8, 9, 10])]
    assert taken == {0, 2, 7, 8, 9, 10}
