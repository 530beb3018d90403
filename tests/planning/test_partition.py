"""trainer_lib.planning's partition and cost: balanced data-parallel slots (every sample once,
isolation, equal slot counts, the pad rule of vision slots, the micro-batch floor, the
token-spread guarantee, the long-sample slots), the FLOP cost model and the sync-idle measure; and
the same through plan_step on bench/pack.py's mix."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer_lib.planning import grouped, partition
from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY, TopUp, lpt_bins, plan_bins
from trainer_lib.planning.cost import H100_FORWARD_FLOPS_PER_S, CostModel, sync_idle
from trainer_lib.planning.items import EITHER, MiniBatchItems
from trainer_lib.planning.partition import partition_mini_batch
from trainer_lib.planning.plan import plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.planning.refine import Refinement
from trainer_lib.planning.repack import min_slack_bins
from trainer_lib.planning.slot_bound import min_micro_batches


def slot_spread(part, k: int) -> int:
    return max(row[k] for row in part.tokens) - min(row[k] for row in part.tokens)


@st.composite
def mini_batches(draw, max_size: int = 80):
    cap = draw(st.sampled_from([50, 200, 1000]))
    n = draw(st.integers(0, max_size))
    lengths = draw(st.lists(st.integers(1, cap + cap // 2), min_size=n, max_size=n))
    keys = draw(st.lists(st.sampled_from(["a", "a", "a", "b", ("c", "lora")]), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from([NEUTRAL, NEUTRAL, PIXELS, PIXELS, STRAY]), min_size=n, max_size=n))
    groups = [draw(st.sampled_from("abcdef")) if k == PIXELS else None for k in kinds]
    per_group = {g: draw(st.integers(1, 50)) for g in "abcdef"}  # a group's samples show one image set
    vision = [per_group[g] if g is not None else 0 for g in groups]
    return lengths, keys, kinds, vision, cap, groups


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=mini_batches(),
    dp=st.integers(1, 6),
    reserve=st.sampled_from([0, 0, 3, 6]),
    stretch=st.booleans(),
    by_compute=st.booleans(),
    one_key=st.booleans(),
    clip=st.booleans(),
    refine=st.sampled_from([None, None, Refinement(), Refinement(anneal_steps=500)]),
)
def test_partition_rules(batch, dp, reserve, stretch, by_compute, one_key, clip, refine):
    """Every rule, on the token-balanced plan and, with ``groups``, the compute-balanced one (one
    key is where it applies: drawn half the time, then half of those with nothing above the cap),
    with and without the search (``refine``)."""
    lengths, keys, kinds, vision, cap, groups = batch
    if one_key:
        keys = ["a"] * len(lengths)
        lengths = [min(n, cap) for n in lengths] if clip else lengths
    part = partition_mini_batch(
        MiniBatchItems(
            lengths,
            dp=dp,
            cap=cap,
            keys=keys,
            kinds=kinds,
            vision=vision,
            reserve=reserve,
            stretch=stretch,
            groups=groups if by_compute else None,
            language=[n * (1 + n / (4 * cap)) for n in lengths] if by_compute else None,
        ),
        refine,
    )
    reserve = reserve if dp > 1 else 0  # one rank: nothing to align, no pad
    m = part.num_micro_batches
    assert len(part.ranks) == len(part.tokens) == dp
    assert all(len(row) == m for row in part.ranks) and all(len(row) == m for row in part.tokens)
    seen = sorted(i for row in part.ranks for b in row for i in b)
    assert seen == list(range(len(lengths)))  # every sample exactly once
    for k in range(m):
        longest = max(lengths[i] for row in part.ranks for i in row[k])
        room = max(cap, longest) if stretch else cap  # stretched: up to the slot's longest sample
        for r, row in enumerate(part.ranks):
            b = row[k]
            assert b == sorted(b) and part.tokens[r][k] == sum(lengths[i] for i in b)
            assert len({keys[i] for i in b}) <= 1  # isolation
            has = {kinds[i] for i in b}
            assert not has >= {PIXELS, STRAY}
            assert part.tokens[r][k] <= room or len(b) == 1  # the cap, unless one long sample
            if part.slot_has_pixels[k]:  # the vision tower runs on every rank
                assert STRAY not in has
                assert PIXELS in has or part.tokens[r][k] + reserve <= room  # room for the image pad
            else:
                assert PIXELS not in has
    if not stretch:
        assert m >= min_micro_batches(lengths, dp_size=dp, cap=cap, kinds=kinds, reserve=reserve)
    assert m == 0 or any(part.ranks[r][-1] for r in range(dp))  # no slot of pads alone at the end
    # the guarantee that always holds: ranks differ by at most the largest spread inside a slot
    spread = max(part.rank_tokens) - min(part.rank_tokens)
    assert spread <= max((slot_spread(part, k) for k in range(m)), default=0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cap=st.sampled_from([100, 1000, 16384]),
    data=st.data(),
    dp=st.integers(1, 8),
    stray=st.booleans(),
)
def test_one_key_spread_is_at_most_the_largest_sample(cap, data, dp, stray):
    """One key, no images, no sample above the cap: head slots hold FFD's full bins (spread below
    the largest sample); a last slot with room for the largest sample in every bin is LPT-balanced
    (spread at most the largest sample). So the ranks differ by at most the largest sample."""
    lengths = data.draw(st.lists(st.integers(1, cap), min_size=1, max_size=120))
    kinds = [STRAY if stray and i % 7 == 0 else NEUTRAL for i in range(len(lengths))]
    part = partition_mini_batch(MiniBatchItems(lengths, dp=dp, cap=cap, kinds=kinds))
    largest, m = max(lengths), part.num_micro_batches
    for k in range(m - 1):
        assert slot_spread(part, k) < largest
    last = sum(row[-1] for row in part.tokens)
    if last <= dp * (cap - largest):
        assert slot_spread(part, m - 1) <= largest
        assert max(part.rank_tokens) - min(part.rank_tokens) <= largest


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=mini_batches(120))
def test_plan_bins_keeps_groups_together_without_costing_a_bin(batch):
    """``groups``: every item once, the cap, isolation and kinds kept, never more bins than plain
    first-fit-decreasing."""
    lengths, keys, kinds, _, cap, groups = batch
    plain = plan_bins(lengths, cap, keys=keys, kinds=kinds)
    grouped = plan_bins(lengths, cap, keys=keys, kinds=kinds, groups=groups)
    assert len(grouped) <= len(plain)
    assert sorted(i for b in grouped for i in b) == list(range(len(lengths)))
    for b in grouped:
        assert b == sorted(b) and len({keys[i] for i in b}) <= 1
        assert sum(lengths[i] for i in b) <= cap or len(b) == 1
        assert not {kinds[i] for i in b} >= {PIXELS, STRAY}


def test_plan_bins_puts_a_group_in_the_fewest_bins_first_fit_allows():
    """Three groups of four samples (110 tokens each), cap 112: first-fit-decreasing interleaves
    them (all three groups in every bin: each image encoded 3 times), grouped first fit gives each
    group a bin of its own, the same 3 bins."""
    lengths = [50, 48, 46, 30, 32, 28, 20, 18, 22, 10, 12, 14]
    groups = ["a", "b", "c"] * 4
    plain = plan_bins(lengths, 112)
    grouped = plan_bins(lengths, 112, groups=groups)
    assert [sorted({groups[i] for i in b}) for b in plain] == [["a", "b", "c"]] * 3
    assert [sorted({groups[i] for i in b}) for b in grouped] == [["a"], ["b"], ["c"]]


def test_lpt_bins_fills_the_least_loaded_bin_and_skips_what_no_longer_fits():
    lengths = [5, 4, 3, 3, 1]
    keys = [None] * 5
    # needed: 5 | 4; optional, largest first, only within 7: 3 -> the 4-bin (7); the next 3 fits
    # no bin any more (least load 5), the 1 joins the 5-bin
    bins, left = lpt_bins([0, 1], lengths, keys, 2, 10, TopUp([2, 3, 4], target=7))
    assert bins == [[0, 4], [1, 2]] and left == [3]
    assert lpt_bins([0, 1, 2], [8, 8, 8], keys[:3], 2, 10) is None  # 8 + 8 > 10 in one bin
    assert lpt_bins([0, 1], lengths, ["a", "b", None, None, None], 1, 10) is None  # two keys, one bin


def test_equal_samples_fill_every_slot_exactly():
    part = partition_mini_batch(MiniBatchItems([1000] * 64, dp=4, cap=4000))
    assert part.num_micro_batches == 4 == min_micro_batches([1000] * 64, dp_size=4, cap=4000)
    assert part.tokens == [[4000] * 4] * 4


def test_a_light_last_slot_is_spread_over_every_rank():
    """FFD alone gives 8 full bins and one of 2 x 300: the last slot becomes 4 bins of 300 tokens
    spread over 4 ranks, not one rank with 600 and three with nothing."""
    lengths = [500] * 16 + [300] * 4
    part = partition_mini_batch(MiniBatchItems(lengths, dp=4, cap=1000))
    assert part.num_micro_batches == 3
    assert [row[:2] for row in part.tokens] == [[1000, 1000]] * 4
    assert [row[2] for row in part.tokens] == [300] * 4


def test_stray_text_gets_a_text_slot_on_every_rank_topped_up_with_plain_text():
    """A stray-placeholder sample may not meet pixels, and FSDP runs the vision tower in a slot on
    all ranks or none: it gets a text slot, which plain text fills on the other ranks."""
    lengths = [900] * 8 + [400] * 6 + [350]
    kinds = [PIXELS] * 8 + [NEUTRAL] * 6 + [STRAY]
    part = partition_mini_batch(MiniBatchItems(lengths, dp=4, cap=1000, kinds=kinds, reserve=6))
    assert part.slot_has_pixels == [True, True, False]
    text_slot = [row[2] for row in part.ranks]
    assert sorted(i for b in text_slot for i in b) == list(range(8, 15))
    assert [row[2] for row in part.tokens] == [800, 800, 750, 400]  # LPT; 7 samples in 4 bins


def test_text_near_the_cap_never_sits_in_a_vision_slot():
    """A text sample within ``reserve`` tokens of the cap has no room for the image pad."""
    lengths = [600, 600, 998]
    kinds = [PIXELS, PIXELS, NEUTRAL]
    part = partition_mini_batch(MiniBatchItems(lengths, dp=2, cap=1000, kinds=kinds, reserve=6))
    assert part.slot_has_pixels == [True, False]
    assert sorted(part.ranks[r][1] for r in range(2)) == [[], [2]]
    relaxed = partition_mini_batch(MiniBatchItems(lengths, dp=2, cap=1000, kinds=kinds, reserve=2))
    assert relaxed.num_micro_batches == 2 and relaxed.slot_has_pixels == [True, True]


def test_a_text_slot_paced_by_its_longest_sample_takes_text_up_to_that_length():
    """The near-cap sample sets its text slot's pace: the slot's other bin takes plain text up to
    its length (800 of 998 tokens, not the mini-batch's expected fill of 700), which the vision
    slots then do without: the slots' maxima sum to 600 + 600 + 998 (before: 800 + 600 + 998)."""
    lengths = [400] * 4 + [998] + [200] * 8
    kinds = [PIXELS] * 4 + [NEUTRAL] * 9
    items = MiniBatchItems(
        lengths, dp=2, cap=1000, kinds=kinds, reserve=6, groups=["a", "b"] * 2 + [None] * 9,
        language=lengths, vision=[1.0] * 4 + [0.0] * 9,
    )  # fmt: skip
    part = partition_mini_batch(items)
    assert part.slot_has_pixels == [True, True, False]
    assert sorted(row[2] for row in part.tokens) == [800, 998]
    assert sum(max(row[k] for row in part.tokens) for k in range(3)) == 600 + 600 + 998


def test_keys_with_few_samples_still_give_every_rank_the_same_slots():
    lengths = [400] * 20 + [100]
    keys = ["big"] * 20 + ["lora-x"]
    part = partition_mini_batch(MiniBatchItems(lengths, dp=4, cap=1000, keys=keys))
    assert {len(row) for row in part.ranks} == {part.num_micro_batches}
    lone = [(r, k) for r, row in enumerate(part.ranks) for k, b in enumerate(row) if 20 in b]
    assert len(lone) == 1 and part.ranks[lone[0][0]][lone[0][1]] == [20]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="dp, cap >= 1"):
        partition_mini_batch(MiniBatchItems([1], dp=0, cap=10))
    with pytest.raises(ValueError, match="reserve"):
        partition_mini_batch(MiniBatchItems([1], dp=1, cap=10, reserve=10))
    with pytest.raises(ValueError, match="kinds"):
        partition_mini_batch(MiniBatchItems([1, 2], dp=1, cap=10, kinds=[NEUTRAL]))
    with pytest.raises(ValueError, match=">= 1"):
        partition_mini_batch(MiniBatchItems([0], dp=1, cap=10))
    with pytest.raises(ValueError, match="NEUTRAL"):
        partition_mini_batch(MiniBatchItems([1], dp=1, cap=10, kinds=[7]))
    assert partition_mini_batch(MiniBatchItems([], dp=3, cap=10)).ranks == [[], [], []]


def test_sync_idle_counts_each_stage_at_its_slowest_rank():
    assert sync_idle([[[4, 4], [4, 4]]]) == 0.0
    assert sync_idle([[[4], [2]]]) == pytest.approx(1 - 6 / 8)
    # two stages: vision 2 vs 0 and language 1 vs 3 -> waits 2*2 + 2*3 = 10 for 6 of work
    assert sync_idle([[[2], [0]], [[1], [3]]]) == pytest.approx(1 - 6 / 10)
    # pads take time but do no work: 4 + 0 of work, the slot lasts 2 + 3 on rank 1
    assert sync_idle([[[4], [2]]], [[[0], [3]]]) == pytest.approx(1 - 6 / 10)
    assert sync_idle([[[], []]]) == 0.0
    with pytest.raises(ValueError, match="slot counts"):
        sync_idle([[[1, 2], [1]]])
    with pytest.raises(ValueError, match="slot counts"):
        sync_idle([[[1], [1]]], [[[1], [1, 2]]])


def test_cost_model_of_qwen2_vl_2b_from_its_published_shapes(bench_mix):
    """Hand-counted FLOPs of Qwen2-VL-2B (hidden 1536, MLP 8960, 28 layers, 12 heads of 128, 2 KV
    heads, vocab 151936; vision 32 layers of width 1280, MLP 5120, patch 14, merge 2): the cost
    model of ``bench/_models.py``'s config of the published shapes."""
    _, cm = bench_mix
    layer = 2 * 1536 * (1536 + 256 + 256 + 1536) + 3 * 2 * 1536 * 8960
    assert cm.llm_per_token == 28 * layer + 2 * 1536 * 151936
    assert cm.llm_per_token_sq == 28 * 2 * 1536
    patch = 32 * (2 * 1280 * 3840 + 2 * 1280 * 1280 + 2 * 2 * 1280 * 5120) + 2 * 1176 * 1280
    merger = 2 * 5120 * 5120 + 2 * 5120 * 1536
    assert cm.vision_per_token == 4 * patch + merger
    assert cm.vision_per_token_sq == 32 * 4 * 1280 * 16
    assert cm.language(100) == 100 * cm.llm_per_token + 10_000 * cm.llm_per_token_sq
    assert cm.vision([4, 2]) == 6 * cm.vision_per_token + 20 * cm.vision_per_token_sq
    # a 1296-token image costs its vision tower more than its 1296 tokens cost the language model
    assert cm.vision([1296]) > cm.language(1296)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_cost_model_reads_the_other_qwen_families(family):
    from transformers import AutoConfig

    from helpers import ensure_tiny_model

    cm = CostModel.from_config(AutoConfig.from_pretrained(ensure_tiny_model(family)))
    assert min(cm.llm_per_token, cm.llm_per_token_sq, cm.vision_per_token, cm.vision_per_token_sq) > 0
    assert cm.seconds_per_unit == 1 / H100_FORWARD_FLOPS_PER_S  # FLOPs in the fitted card's seconds


def test_cost_model_names_the_supported_families():
    from types import SimpleNamespace

    config = SimpleNamespace(
        text_config=SimpleNamespace(
            hidden_size=8,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=16,
            num_hidden_layers=1,
            vocab_size=10,
        ),
        vision_config=SimpleNamespace(model_type="kimi_vl_vision"),
    )
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl, qwen3_vl"):
        CostModel.from_config(config)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    dp=st.integers(1, 4),
    mbs=st.sampled_from([3, 8, 16]),
    cap=st.sampled_from([2048, 4096, 16384]),
    stretch=st.booleans(),
)
def test_plan_step_on_the_bench_mix(bench_mix, seed, dp, mbs, cap, stretch):
    """plan_step with a cost model on real-shaped samples (images of 64..1296 tokens, a stray
    placeholder next to them): every sample once, divisibility, the same slot count on every rank,
    the vision tower on every rank or none in each slot, the cap (or the slot's longest sample)
    kept, the rank totals within the largest slot spread, and the reports add up."""
    import numpy as np

    pack, cm = bench_mix
    samples = pack.make_step(np.random.default_rng(seed), prompts=3, rollouts=4)
    samples[1] = pack.TrainingSample(  # a stray placeholder in text, next to images
        input_ids=[5, pack.TOK, 6, 7], loss_mask=[False, False, True, True], advantages=[0.5] * 4,
        inference_logprobs=[-1.0] * 4, run_id="run_1",
    )  # fmt: skip
    plan = plan_step(
        samples,
        pack.SPEC,
        StepShape(
            dp_size=dp, mini_batch_size=mbs, seq_len=16384, micro_batch_max_tokens=cap, stretch_cap=stretch
        ),
        cost_model=cm,
    )
    total = len(samples) + plan.num_padding_samples
    assert total % math.lcm(dp, mbs) == 0 and len(plan.mini_batches) == total // mbs  # divisibility
    seen = []
    for ranks, loads in zip(plan.mini_batches, plan.rank_loads, strict=True):
        assert len(ranks) == dp and len({r.num_micro_batches for r in ranks}) == 1
        indexed = [s.sample_index for r in ranks for mb in r.micro_batches for s in mb.slots]
        assert len([i for i in indexed if i is not None]) == mbs  # samples and sample-count pads, once
        slots = list(zip(*(r.micro_batches for r in ranks), strict=True))
        for column in slots:
            assert len({mb.has_pixels for mb in column}) == 1
            longest = max(s.length for mb in column for s in mb.slots if s.sample_index is not None)
            room = max(cap, longest) if stretch else cap
            for mb in column:
                assert mb.num_tokens <= room or mb.sample_count == 1
                assert not (mb.has_pixels and any(s.stray_placeholders for s in mb.slots))
        work = [[sum(s.length for s in mb.slots if s.sample_index is not None) for mb in c] for c in slots]
        spread = [max(c) - min(c) for c in work]
        rank_work = [sum(c[r] for c in work) for r in range(dp)]
        assert max(rank_work) - min(rank_work) <= max(spread)  # (G1)
        for share, load in zip(ranks, loads, strict=True):
            assert load.micro_batches == share.num_micro_batches and load.tokens == share.num_tokens
            assert load.loss_tokens == share.num_loss_tokens
            assert load.vision_tokens == sum(
                im.length for mb in share.micro_batches for im in mb.images if im.ref is not None
            )
            seen += [s.sample_index for mb in share.micro_batches for s in mb.slots if not s.is_padding]
    assert sorted(seen) == list(range(len(samples)))
    assert plan.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)
    assert 0.0 <= plan.sync_idle() < 1.0 and 0.0 <= plan.sync_idle(cm) < 1.0


def test_compute_balance_keeps_groups_together_and_cuts_the_step_on_the_bench_mix(bench_mix):
    """Issue 29 on one bench step (dp 8, mini-batch 256, cap 16k): the compute-balanced plan
    (default) runs the slot floor like the token-balanced one, encodes each group's image in a
    fraction of the micro-batches, idles less in FLOPs and predicts a shorter step (the slowest
    rank's FLOPs summed over slots)."""
    import numpy as np

    from trainer_lib.planning.plan import encoded_image_tokens

    pack, cm = bench_mix
    samples = pack.make_step(np.random.default_rng(1))
    shape = StepShape(dp_size=8, mini_batch_size=256, seq_len=16384)
    plans = {b: plan_step(samples, pack.SPEC, shape, cost_model=cm, balance=b) for b in ("compute", "tokens")}

    def step_flops(plan) -> float:
        return sum(
            max(sum(cm.language(s.length) for s in mb.slots) for mb in column)
            + max(cm.vision(encoded_image_tokens(mb)) for mb in column)
            for ranks in plan.mini_batches
            for column in zip(*(r.micro_batches for r in ranks), strict=True)
        )

    def encoded(plan) -> float:
        loads = [load for ranks in plan.rank_loads for load in ranks]
        return sum(x.encoded_images for x in loads) / sum(x.image_slots for x in loads)

    compute, tokens = plans["compute"], plans["tokens"]
    assert [r[0].num_micro_batches for r in compute.mini_batches] == [
        r[0].num_micro_batches for r in tokens.mini_batches
    ]
    assert encoded(compute) < 0.4 < 0.7 < encoded(tokens)
    assert compute.sync_idle(cm) < tokens.sync_idle(cm) / 2
    assert step_flops(compute) < 0.85 * step_flops(tokens)


def test_a_heavy_bin_joins_the_slot_of_its_vision_peers():
    """Step 3 of the compute plan: a bin holding one sample above the language level sets its
    slot's language pace wherever it goes, so it goes to the slot where its vision cost ranks,
    not ahead of the densest images (there it would leave its rank's tower idle)."""
    bins = grouped._Bins(8)
    for j, (group, load) in enumerate([("A", 10)] * 4 + [("B", 10), ("B", 10), ("B", 20), (None, 10)]):
        bins.add(j, j, load, load, group)
    cost = {"A": 100.0, "B": 10.0}
    order = grouped._slot_order(bins, cost, level=sum(bins.load) / 8, dp=2)
    assert order[4] == 6 and sorted(order) == list(range(8))  # the heavy bin opens the third slot

    def vision_maxima(o: list[int]) -> float:
        return sum(max(sum(cost[g] for g in bins.groups[j]) for j in o[s : s + 2]) for s in range(0, 8, 2))

    assert vision_maxima(order) == 220 < vision_maxima([6, 0, 1, 2, 3, 4, 5, 7]) == 310  # heavy first


def test_a_group_remainder_joins_a_bin_holding_its_images_while_within_the_level():
    """Step 2 of the compute plan: a leftover sample of a group goes to the least loaded bin that
    already holds the group (no new encode) while that bin stays within the level; past it, and
    for text, to the least loaded bin with room (LPT)."""
    lengths, language = [50, 10, 30, 30, 10, 5], [50.0, 10.0, 30.0, 70.0, 10.0, 5.0]
    groups = ["A", "B", "B", "A", "A", None]

    kinds = [NEUTRAL if g is None else PIXELS for g in groups]
    items = MiniBatchItems(lengths, dp=3, cap=100, kinds=kinds, groups=groups, language=language)
    assert items.image_sets == groups

    def level(**kw) -> list[list[int]]:
        bins = grouped._Bins(3)
        for j in range(3):
            bins.add(j, j, language[j], lengths[j], groups[j])
        assert grouped._level(bins, [3, 4, 5], items, **kw)
        return bins.items

    assert level(level=65.0) == [[0, 4], [1, 3], [2, 5]]  # 70 joins no A bin within 65: LPT
    assert level() == [[0], [1, 3], [2, 4, 5]]  # LPT alone: A encoded in a third bin


def test_text_slots_are_evened_by_language_cost():
    """Text slots are packed by tokens; in the compute plan they are re-dealt by language cost
    (causal attention makes a long sample cost more than its tokens): equal tokens, unequal
    language before, the slowest rank's language lower after, every sample once, the cap kept."""
    lengths = [60, 40, 20, 20, 20, 20, 10, 10]
    language = [n * (1 + n / 50) for n in lengths]
    slot = [(100, [0, 1]), (100, [2, 3, 4, 5, 6, 7])]
    (after,) = grouped.even_text_slots([slot], MiniBatchItems(lengths, dp=2, cap=100, language=language))
    cost = [sum(language[i] for i in b) for _, b in after]
    assert max(cost) < max(sum(language[i] for i in b) for _, b in slot)
    assert sorted(i for _, b in after for i in b) == list(range(8))
    assert all(t == sum(lengths[i] for i in b) <= 100 for t, b in after)


def test_long_samples_share_a_slot_and_stretching_fills_it():
    """Two 1500-token samples above a 1000-token cap run alone: they share one slot, whose other
    bins hold at most the cap; with stretch_cap they take up to 1500 tokens instead of idling."""
    lengths = [1500, 1500] + [500] * 12
    strict = partition_mini_batch(MiniBatchItems(lengths, dp=4, cap=1000))
    assert sorted(row[0] for row in strict.tokens) == [1000, 1000, 1500, 1500]
    assert strict.num_micro_batches == 2
    stretched = partition_mini_batch(MiniBatchItems(lengths, dp=4, cap=1000, stretch=True))
    assert [row[0] for row in stretched.tokens] == [1500] * 4
    assert stretched.num_micro_batches == 2  # 6 x 500 left for 4 ranks: LPT, spread one sample
    assert sorted(row[1] for row in stretched.tokens) == [500, 500, 1000, 1000]


@settings(max_examples=300, deadline=None)
@given(
    bins=st.lists(st.lists(st.integers(1, 60), max_size=4), min_size=1, max_size=8),
    items=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    limit=st.integers(60, 120),
)
def test_relocate_keeps_limits_and_never_lightens_a_bin(bins, items, limit):
    """Step 4's moves: best fit, else one trade that makes room; every sample stays exactly once,
    no bin goes above its limit, and no bin loses tokens (full bins stay full: G2 holds)."""
    lengths, state = [], []
    for b in bins:
        start = len(lengths)
        for n in b:
            if sum(lengths[start:]) + n <= limit:
                lengths.append(n)
        state.append([sum(lengths[start:]), list(range(start, len(lengths))), limit, False])
    extra = list(range(len(lengths), len(lengths) + len(items)))
    lengths += items
    mini_batch = MiniBatchItems(lengths, dp=1, cap=limit, keys=["k"] * len(lengths))
    assert mini_batch.place == [EITHER] * len(lengths)
    before = [c[0] for c in state]
    if partition._relocate(mini_batch, extra, state):
        assert sorted(i for c in state for i in c[1]) == list(range(len(lengths)))
        for c, was in zip(state, before, strict=True):
            assert c[0] == sum(lengths[i] for i in c[1]) <= limit and c[0] >= was
    else:
        assert len(items) > 1 or items[0] > limit - min(before)  # one sample that fits is never refused


def test_a_slot_one_trade_can_empty_is_dropped():
    """bench/pack.py's cap-8k mini-batch 3: FFD + LPT leave a 521-token sample alone in a 9th
    slot; no bin has 521 tokens of room, but trading 3612 for 3070 between two bins makes it."""
    lengths = [3070, 1852, 1551, 1206, 3612, 1688, 1511, 1010, 521]
    bins = [[sum(lengths[:4]), [0, 1, 2, 3], 8186, True], [sum(lengths[4:8]), [4, 5, 6, 7], 8186, True]]
    assert all(c[2] - c[0] < 521 for c in bins)
    items = MiniBatchItems(lengths, dp=2, cap=8192, keys=["k"] * 9, reserve=6)
    assert partition._relocate(items, [8], bins)
    assert sorted(i for c in bins for i in c[1]) == list(range(9))
    assert all(c[0] == sum(lengths[i] for i in c[1]) <= 8186 for c in bins)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 150), max_size=60),
    cap=st.sampled_from([1, 50, 100]),
    data=st.data(),
)
def test_min_slack_bins_keeps_plan_bins_contract(lengths, cap, data):
    """Every item once; one key per bin; at most ``cap`` unless one longer item; bins by key, then
    creation, indices ascending; and the any-fit property (G2's head): every bin but the last of
    its key holds more than ``cap`` minus the key's largest item that fits."""
    keys = data.draw(st.lists(st.sampled_from("ab"), min_size=len(lengths), max_size=len(lengths)))
    bins = min_slack_bins(lengths, cap, keys=keys)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b == sorted(b) and len({keys[i] for i in b}) == 1 for b in bins)
    assert all(sum(lengths[i] for i in b) <= cap or len(b) == 1 for b in bins)
    order = [keys[b[0]] for b in bins]
    assert order == sorted(order, key=list(dict.fromkeys(keys)).index)  # keys in first-seen order
    for key in set(keys):
        fit = [b for b in bins if keys[b[0]] == key and sum(lengths[i] for i in b) <= cap]
        largest = max((lengths[i] for b in fit for i in b), default=0)
        assert all(sum(lengths[i] for i in b) > cap - largest for b in fit[:-1])
        tokens = sum(lengths[i] for b in fit for i in b)
        assert len(fit) >= -(-tokens // cap)


def test_min_slack_bins_completes_a_bin_that_first_fit_leaves_short():
    """cap 100: first fit puts 46 + 46 together (92, no item of <= 8 left) and then needs a third
    bin; opening with 46 and completing it with 32 + 22 (exactly 100) leaves 46 + 18 + 17 + 17."""
    lengths = [46, 46, 32, 22, 18, 17, 17]
    assert len(plan_bins(lengths, 100)) == 3
    assert min_slack_bins(lengths, 100) == [[0, 2, 3], [1, 4, 5, 6]]


def test_the_slot_bound_is_reached_where_first_fit_and_one_trade_miss_it():
    """The same samples on 2 ranks: FFD's three bins need two slots and no single trade empties
    the second (its one 17-token sample fits no bin, nor does any trade make 17 tokens of room);
    the plan is re-made with minimum bin slack and holds the one slot the bound allows."""
    lengths = [46, 46, 32, 22, 18, 17, 17]
    assert min_micro_batches(lengths, dp_size=2, cap=100) == 1
    part = partition_mini_batch(MiniBatchItems(lengths, dp=2, cap=100))
    assert part.num_micro_batches == 1 and sorted(part.tokens) == [[98], [100]]


def test_two_samples_above_the_cap_never_share_a_bin_across_keys():
    """Two keys, three ranks, samples of 300, 120, 110 above a cap of 100: key ``a``'s two long
    samples once shared one bin (230 tokens at cap 100: the long slot's bins closed at the
    slot's longest sample). Each now runs alone, or the plan holds them apart otherwise; with
    ``stretch_cap`` a bin may hold up to the slot's longest sample."""
    lengths, keys = [300, 120, 110, 5], ["b", "a", "a", "b"]
    for stretch in (False, True):
        plan = partition_mini_batch(MiniBatchItems(lengths, dp=3, cap=100, keys=keys, stretch=stretch))
        limit = max(lengths) if stretch else 100
        bins = [b for rank in plan.ranks for b in rank if b]
        assert sorted(i for b in bins for i in b) == [0, 1, 2, 3]
        for b in bins:
            assert len(b) == 1 or sum(lengths[i] for i in b) <= limit, (stretch, plan.ranks)
            assert len({keys[i] for i in b}) == 1


def test_grouped_first_fit_tries_every_bin_with_room():
    """With groups the items are visited group by group, not by size: a bin with room for a later,
    smaller item is still tried (it was skipped once, costing a bin)."""
    for groups in (None, ["A", "B", "C"], ["A", "B", None]):
        assert plan_bins([10, 1, 5], 12, groups=groups) == [[0, 1], [2]], groups
