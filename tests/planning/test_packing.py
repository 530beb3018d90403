"""trainer_lib.planning's packing, padding, ranks and plan: FFD bins, isolation, image runs,
accounting, dp steps."""

from __future__ import annotations

import functools
import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FAKE, PAD, SPEC, TOK, count, make_ref, make_sample
from protocol.errors import PlaceholderMismatch
from protocol.placeholders import locate_image_runs
from protocol.structs import RawMMRef, TrainingSample, decode_microbatch, encode
from trainer_lib.model_inputs import check_placeholders_match_features
from trainer_lib.planning.bins import (
    NEUTRAL,
    PIXELS,
    STRAY,
    _first_fit,
    _first_fit_scan,
    bin_capacity,
    plan_bins,
)
from trainer_lib.planning.packing import pack_samples, rebuild_micro_batch
from trainer_lib.planning.padding import padded_sample_count
from trainer_lib.planning.plan import mini_batch_entries, plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.planning.slot_bound import min_micro_batches
from trainer_lib.spec import PackingSpec

# --- hypothesis strategies ---------------------------------------------------------------------------

REF_POOL = [
    make_ref(h, w, s) for h, w, s in [(1, 1, 0), (2, 3, 1), (4, 4, 2), (3, 5, 3), (8, 6, 4), (2, 2, 5)]
]


@st.composite
def samples_strategy(draw, max_size: int = 24):
    n = draw(st.integers(1, max_size))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["text", "text", "stray", "image", "image"]))
        text = draw(st.lists(st.integers(0, 255), min_size=0, max_size=draw(st.sampled_from([4, 40, 200]))))
        run_id = draw(st.sampled_from(["run_a", "run_b"]))
        lora_id = draw(st.sampled_from([None, None, "l1"]))
        completion = draw(st.integers(1, 60))
        typed = draw(st.booleans())
        if kind == "stray":
            text = [*text, TOK, *text[:3]]
            out.append(make_sample(text, typed=typed, completion=completion, run_id=run_id, lora_id=lora_id))
        elif kind == "image":
            refs = draw(st.lists(st.sampled_from(REF_POOL), min_size=1, max_size=3))
            adjacent = draw(st.booleans())
            out.append(
                make_sample(
                    text,
                    refs,
                    adjacent=adjacent,
                    typed=typed,
                    completion=completion,
                    run_id=run_id,
                    lora_id=lora_id,
                )
            )
        else:
            out.append(make_sample(text, completion=completion, run_id=run_id, lora_id=lora_id))
    return out


def check_step_invariants(samples, step, cap):
    seen = []
    for mb in step.micro_batches:
        m = mb.micro_batch
        L = len(m.input_ids)
        # per-token arrays aligned
        assert L == mb.num_tokens == len(m.loss_mask) == len(m.advantages) == len(m.inference_logprobs)
        assert len(mb.mm_token_type_ids) == L and sum(m.seq_lens) == L
        assert m.sample_count == len(m.seq_lens) == len(mb.slots)
        # the cap holds unless the bin is one oversized sample
        assert L <= cap or (m.sample_count == 1 and L > cap)
        # isolation
        keys = {(samples[s.sample_index].run_id, samples[s.sample_index].lora_id) for s in mb.slots}
        assert keys == {(mb.run_id, mb.lora_id)}
        assert not (mb.has_pixels and any(s.stray_placeholders for s in mb.slots))
        # each sample's tokens, rebased image spans and refs
        refs = []
        typed = np.zeros(L, dtype=np.int8)
        for k, s in enumerate(mb.slots):
            src = samples[s.sample_index]
            seen.append(s.sample_index)
            assert m.seq_lens[k] == len(src.input_ids) == s.length
            assert m.input_ids[s.start : s.start + s.length] == src.input_ids
            assert m.loss_mask[s.start : s.start + s.length] == src.loss_mask
            assert m.advantages[s.start : s.start + s.length] == src.advantages
            assert s.num_loss_tokens == sum(src.loss_mask)
            src_refs = list(src.mm_refs.items) if src.mm_refs else []
            assert s.num_images == len(src_refs)
            spans = mb.images[s.first_image : s.first_image + s.num_images]
            for span, ref in zip(spans, src_refs, strict=True):
                assert span.slot == k and span.ref == ref and span.length == ref.num_placeholders
                assert s.start <= span.start and span.start + span.length <= s.start + s.length
                assert set(m.input_ids[span.start : span.start + span.length]) == {TOK}
                typed[span.start : span.start + span.length] = 1
            refs += src_refs
        assert m.mm_refs == refs
        assert mb.mm_token_type_ids == typed.tolist()
        assert mb.num_loss_tokens == sum(m.loss_mask)
    # every sample in exactly one micro-batch
    assert sorted(seen) == list(range(len(samples)))
    # token accounting is exact and summed over micro-batches
    assert step.num_tokens == sum(len(s.input_ids) for s in samples)
    assert step.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)
    assert step.num_samples == len(samples)


def reference_ffd(lengths, cap, keys, kinds):
    """Plain-Python first-fit-decreasing with the same rules, to check plan_bins against."""
    out = []
    for key in dict.fromkeys(keys):
        members = [i for i in range(len(lengths)) if keys[i] == key]
        bins = []  # [room, has_pix, has_stray, items]
        for i in sorted(members, key=lambda i: -lengths[i]):
            size, kind = lengths[i], kinds[i]
            for b in bins:
                if (
                    size <= cap
                    and b[0] >= size
                    and not (kind == PIXELS and b[2])
                    and not (kind == STRAY and b[1])
                ):
                    break
            else:
                b = [cap if size <= cap else -1 + size, False, False, []]
                bins.append(b)
            b[0] -= size
            b[1] |= kind == PIXELS
            b[2] |= kind == STRAY
            b[3].append(i)
        out += [sorted(b[3]) for b in bins]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=60),
    cap=st.integers(1, 400),
    data=st.data(),
)
def test_plan_bins_is_first_fit_decreasing(lengths, cap, data):
    n = len(lengths)
    keys = data.draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=n, max_size=n))
    kinds = data.draw(st.lists(st.sampled_from([NEUTRAL, NEUTRAL, PIXELS, STRAY]), min_size=n, max_size=n))
    bins = plan_bins(lengths, cap, keys=keys, kinds=kinds)
    assert bins == reference_ffd(lengths, cap, keys, kinds)
    assert sorted(i for b in bins for i in b) == list(range(n))
    for b in bins:
        assert sum(lengths[i] for i in b) <= cap or len(b) == 1
        assert len({keys[i] for i in b}) == 1
        assert not ({kinds[i] for i in b} >= {PIXELS, STRAY})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=0, max_size=120),
    cap=st.sampled_from([1, 100, 1000, 4096]),
    data=st.data(),
)
def test_first_fit_scan_and_numpy_search_agree(lengths, cap, data):
    """plan_bins scans the open bins when few are expected, else searches them with numpy: the
    same bins either way."""
    n = len(lengths)
    kinds = data.draw(st.lists(st.sampled_from([NEUTRAL, NEUTRAL, PIXELS, STRAY]), min_size=n, max_size=n))
    order = sorted(range(n), key=lambda i: -lengths[i])
    assert _first_fit_scan(order, lengths, kinds, cap) == _first_fit(order, lengths, kinds, cap)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy(), cap=st.sampled_from([64, 150, 400, 2048]))
def test_pack_samples_properties(samples, cap):
    step = pack_samples(samples, FAKE, seq_len=2048, micro_batch_max_tokens=cap)
    check_step_invariants(samples, step, cap)
    assert step.micro_batch_max_tokens == cap
    assert 0.0 <= step.waste < 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=samples_strategy(max_size=30),
    dp=st.integers(1, 4),
    mbs=st.integers(1, 8),
    critic=st.one_of(st.none(), st.integers(1, 6)),
    cap=st.sampled_from([60, 120, 400]),
    stretch=st.booleans(),
)
def test_plan_step_pads_and_balances(samples, dp, mbs, critic, cap, stretch):
    """Through plan_step: every sample exactly once, isolation, pixels never with a stray
    placeholder, the same micro-batch count on every rank with the vision tower on all or none,
    the cap (stretched: the slot's longest sample), divisibility, pads that never make an optimizer
    step alone, the micro-batch floor, and the guaranteed bound: ranks' token totals differ by at
    most the largest spread inside one slot (docs/PACKING.md §3, G1)."""
    plan = plan_step(
        samples,
        FAKE,
        StepShape(
            dp_size=dp,
            mini_batch_size=mbs,
            critic_mini_batch_size=critic,
            seq_len=400,
            micro_batch_max_tokens=cap,
            stretch_cap=stretch,
        ),
    )
    multiple = math.lcm(dp, mbs, critic or 1)
    total = len(samples) + plan.num_padding_samples
    assert total % multiple == 0 and plan.num_padding_samples < multiple
    assert len(plan.mini_batches) == total // mbs
    seen = []
    for ranks in plan.mini_batches:
        assert len(ranks) == dp
        counts = {r.num_micro_batches for r in ranks}
        assert len(counts) == 1  # same number of forwards on every rank
        slots = list(zip(*(r.micro_batches for r in ranks), strict=True))
        for column in slots:
            assert len({mb.has_pixels for mb in column}) == 1  # vision tower on all or none
            longest = max(s.length for mb in column for s in mb.slots if s.sample_index is not None)
            for mb in column:
                assert mb.num_tokens <= (max(cap, longest) if stretch else cap) or mb.sample_count == 1
        work = [[sum(s.length for s in mb.slots if s.sample_index is not None) for mb in c] for c in slots]
        rank_work = [sum(c[r] for c in work) for r in range(dp)]
        assert max(rank_work) - min(rank_work) <= max(max(c) - min(c) for c in work)  # (G1)
        lengths = [s.length for c in slots for mb in c for s in mb.slots if s.sample_index is not None]
        if not stretch:
            assert counts.pop() >= min_micro_batches(lengths, dp_size=dp, cap=cap)
        for r in ranks:
            for mb in r.micro_batches:
                keys = {(s.sample.run_id, s.sample.lora_id) for s in mb.slots}
                assert keys == {(mb.run_id, mb.lora_id)}  # isolation
                assert not (mb.has_pixels and any(s.stray_placeholders for s in mb.slots))
                for s in mb.slots:
                    if s.is_padding:
                        assert s.num_loss_tokens == 0 and not any(s.sample.loss_mask)
                        assert set(s.sample.advantages) == {0.0}
                    else:
                        seen.append(s.sample_index)
                # pads come after the real samples; synthetic images after real ones
                flags = [s.is_padding for s in mb.slots]
                assert flags == sorted(flags)
                assert_rebuilds(mb)
    assert sorted(seen) == list(range(len(samples)))
    real = [sum(r.num_samples for r in ranks) for ranks in plan.mini_batches]
    assert max(real) - min(real) <= 1  # real samples spread evenly: no optimizer step of pads only
    assert min(real) >= 1 or len(samples) < len(plan.mini_batches)
    assert sum(plan.num_loss_tokens_per_mini_batch) == plan.num_loss_tokens
    assert plan.num_samples == len(samples)
    assert plan.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)  # pads add no loss tokens


def assert_rebuilds(mb, spec=FAKE):
    """msgpack round trip + rebuild_micro_batch gives back the same packed micro-batch."""
    back = rebuild_micro_batch(decode_microbatch(encode(mb.micro_batch)), spec)
    assert back.micro_batch == mb.micro_batch and back.images == mb.images
    assert (back.run_id, back.lora_id, back.num_tokens, back.num_loss_tokens) == (
        mb.run_id, mb.lora_id, mb.num_tokens, mb.num_loss_tokens
    )  # fmt: skip
    same = (
        "start",
        "length",
        "num_images",
        "first_image",
        "num_loss_tokens",
        "is_padding",
        "stray_placeholders",
    )
    for a, b in zip(back.slots, mb.slots, strict=True):
        assert {k: getattr(a, k) for k in same} == {k: getattr(b, k) for k in same}
        assert a.sample.input_ids == b.sample.input_ids and a.sample.loss_mask == b.sample.loss_mask
        assert list(a.sample.mm_refs.items if a.sample.mm_refs else []) == list(
            b.sample.mm_refs.items if b.sample.mm_refs else []
        )
    assert [s.sample_index for s in back.slots] == list(range(mb.sample_count))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy(), cap=st.sampled_from([64, 400]))
def test_micro_batches_survive_the_wire(samples, cap):
    for mb in pack_samples(samples, SPEC, seq_len=cap).micro_batches:
        assert_rebuilds(mb)


def test_rebuild_refuses_a_tampered_micro_batch():
    refs = [make_ref(2, 2), make_ref(1, 3, 1)]
    samples = [make_sample([1] * 5, refs), make_sample([2] * 7), make_sample([3] * 4, refs[:1])]
    (packed,) = pack_samples(samples, SPEC, seq_len=256).micro_batches
    mb = packed.micro_batch
    rebuild = functools.partial(rebuild_micro_batch, spec=SPEC)
    assert rebuild(mb).images == packed.images
    types = list(mb.mm_token_type_ids)
    first_image = types.index(1)
    types[first_image], types[first_image - 1] = 0, 1  # the run shifted by one token
    with pytest.raises(PlaceholderMismatch):
        rebuild(msgspec.structs.replace(mb, mm_token_type_ids=types))
    with pytest.raises(PlaceholderMismatch):  # refs dealt to the wrong samples
        rebuild(msgspec.structs.replace(mb, images_per_sample=list(reversed(mb.images_per_sample))))
    with pytest.raises(ValueError, match="grid"):  # a ref's grid/count no longer matches
        bad_ref = msgspec.structs.replace(mb.mm_refs[0], grid=[1, 4, 6])
        rebuild(msgspec.structs.replace(mb, mm_refs=[bad_ref, *mb.mm_refs[1:]]), spec=FAKE)
    with pytest.raises(ValueError, match="needs mm_token_type_ids"):
        rebuild(msgspec.structs.replace(mb, mm_token_type_ids=None))
    with pytest.raises(PlaceholderMismatch, match=r"grid \[1, 4\] gives no placeholder count"):
        bad_ref = msgspec.structs.replace(mb.mm_refs[0], grid=[1, 4])  # not a (t, h, w) grid
        rebuild(msgspec.structs.replace(mb, mm_refs=[bad_ref, *mb.mm_refs[1:]]), spec=FAKE)


# --- unit tests ---------------------------------------------------------------------------------------


def test_empty_samples_and_a_loss_on_the_first_token_are_refused():
    """The forward has no logprob for a sample's first token; counting a loss there would make
    num_loss_tokens disagree with the loss mask the forward returns."""
    ok = make_sample([1, 2])
    empty = TrainingSample(input_ids=[], loss_mask=[], advantages=[], inference_logprobs=[])
    with pytest.raises(ValueError, match="sample 1 is empty"):
        pack_samples([ok, empty], SPEC, seq_len=64)
    first = msgspec.structs.replace(ok, loss_mask=[True] * len(ok.input_ids))
    with pytest.raises(ValueError, match=r"sample 0: loss_mask\[0\] is True"):
        pack_samples([first], SPEC, seq_len=64)


def test_cap_defaults_to_seq_len_and_may_not_exceed_it():
    assert bin_capacity(4096) == 4096
    assert bin_capacity(4096, 1024) == 1024
    with pytest.raises(ValueError, match="larger than seq_len 4096"):
        bin_capacity(4096, 8192)
    with pytest.raises(ValueError, match="larger than seq_len"):
        pack_samples([], SPEC, seq_len=100, micro_batch_max_tokens=101)


def test_a_sample_longer_than_the_cap_gets_a_bin_of_its_own():
    samples = [make_sample([1] * 10, completion=5), make_sample([1] * 200), make_sample([2] * 3)]
    step = pack_samples(samples, SPEC, seq_len=100)
    bins = [[s.sample_index for s in mb.slots] for mb in step.micro_batches]
    assert bins == [[1], [0, 2]]
    assert step.micro_batches[0].num_tokens == 203 and step.capacity == 203 + 100


def test_stray_placeholder_text_never_shares_a_bin_with_pixels():
    """A literal <|image_pad|> in tool-call text (docs/PACKING.md §1): the scatter would count N+1 vs N."""
    ref = make_ref(2, 2)
    stray = make_sample([5, 6, TOK, 7], typed=True)  # types say text: not an image
    image = make_sample([1, 2], [ref], typed=True)
    plain = make_sample([3] * 4)
    step = pack_samples([stray, image, plain], SPEC, seq_len=1000)
    assert len(step.micro_batches) == 2
    for mb in step.micro_batches:
        assert not (mb.has_pixels and any(s.stray_placeholders for s in mb.slots))
    pix = next(mb for mb in step.micro_batches if mb.has_pixels)
    # the tripwire agrees for the pixel bin (tokens == rows), and would fire had the stray sample joined it
    check_placeholders_match_features(
        pix.micro_batch.input_ids, TOK, 4, mm_token_type_ids=pix.mm_token_type_ids
    )
    with pytest.raises(ValueError, match=r"token id 261: 5 tokens .* but 4 feature rows"):
        check_placeholders_match_features(pix.micro_batch.input_ids + stray.input_ids, TOK, 4)


def test_adjacent_images_are_split_by_their_counts():
    a, b = make_ref(2, 3), make_ref(1, 1)  # 6 and 1 placeholders, back to back
    s = make_sample([9, 9], [a, b, a], adjacent=True)
    assert locate_image_runs(s.input_ids, [a, b, a], TOK) == [(3, 6), (9, 1), (10, 6)]
    mb = pack_samples([make_sample([1]), s], SPEC, seq_len=100).micro_batches[0]
    assert [(im.start, im.length, im.slot) for im in mb.images] == [
        (4 + 3, 6, 1),
        (4 + 9, 1, 1),
        (4 + 10, 6, 1),
    ]
    assert mb.images_per_sample == [0, 3]


def test_image_run_mismatches_name_the_token_and_counts():
    a = make_ref(2, 3)
    s = make_sample([1], [a])
    with pytest.raises(
        PlaceholderMismatch, match=r"6 image placeholder tokens \(id 261\) for 2 image\(s\) needing 12"
    ):
        locate_image_runs(s.input_ids, [a, a], TOK, sample=0)
    # a run that cannot be split into the counts (3 + 4 tokens for images of 4 then 3)
    b, c = make_ref(2, 2), make_ref(1, 3)
    ids = [0] + [TOK] * 3 + [0] + [TOK] * 4
    with pytest.raises(PlaceholderMismatch, match="does not split"):
        locate_image_runs(ids, [b, c], TOK)
    # mm_token_type_ids marking a non-placeholder token
    with pytest.raises(PlaceholderMismatch, match="marks position 0 as image but its id is 5"):
        locate_image_runs([5, TOK], [make_ref(1, 1)], TOK, mm_token_type_ids=[1, 1], counts=[2])
    # a sample with images and an extra placeholder typed as text: the model would scatter into it
    bad = make_sample([TOK, 4], [make_ref(1, 1)], typed=True)
    with pytest.raises(PlaceholderMismatch, match="typed as text"):
        pack_samples([bad], SPEC, seq_len=100)
    # refs whose num_placeholders disagree with their grid
    lying = RawMMRef(ref=a.ref, sha256=a.sha256, media_type="image/jpeg", grid=a.grid, num_placeholders=5)
    with pytest.raises(PlaceholderMismatch, match="claims 5 placeholders, its grid"):
        pack_samples([make_sample([1], [lying])], FAKE, seq_len=100)


def test_check_placeholders_match_features_error_names_everything():
    ids = torch.tensor([[1, TOK, TOK, TOK, 2]])
    features = {"pixel_values": torch.zeros(16, 1176), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    assert check_placeholders_match_features(ids, TOK, torch.zeros(3, 64)) == 3
    with pytest.raises(ValueError) as info:
        check_placeholders_match_features(ids, TOK, features, num_placeholders=count)
    msg = str(info.value)
    assert "261" in msg and "3 tokens" in msg and "4 feature rows" in msg
    assert "(1, 5)" in msg and "pixel_values (16, 1176)" in msg and "image_grid_thw (1, 3)" in msg
    with pytest.raises(ValueError, match=r"features \(2, 64\)"):
        check_placeholders_match_features(ids, TOK, torch.zeros(2, 64))
    with pytest.raises(ValueError, match="not the same positions"):
        check_placeholders_match_features(ids, TOK, 3, mm_token_type_ids=torch.tensor([[0, 1, 1, 0, 1]]))


def test_isolation_by_run_and_lora():
    samples = [
        make_sample([1] * 5, run_id="a"),
        make_sample([1] * 5, run_id="b"),
        make_sample([1] * 5, run_id="a", lora_id="x"),
        make_sample([1] * 5, run_id="a"),
    ]
    step = pack_samples(samples, SPEC, seq_len=1000)
    assert [[s.sample_index for s in mb.slots] for mb in step.micro_batches] == [[0, 3], [1], [2]]
    assert [(mb.run_id, mb.lora_id) for mb in step.micro_batches] == [("a", None), ("b", None), ("a", "x")]


def test_padded_sample_count_and_pads():
    assert padded_sample_count(10, dp_size=4, mini_batch_size=6) == 12
    assert padded_sample_count(10, dp_size=4, mini_batch_size=6, critic_mini_batch_size=8) == 24
    assert padded_sample_count(0, dp_size=2, mini_batch_size=2) == 0
    samples = [make_sample([1, 2], run_id="r", lora_id="l")] * 5
    chunks = mini_batch_entries(samples, SPEC, dp_size=2, mini_batch_size=4)
    assert [[e.sample_index for e in entries] for entries in chunks] == [[0, 1, 2, 5], [3, 4, 6, 7]]
    assert [e.sample for entries in chunks for e in entries if not e.sample.is_padding] == samples
    for pad in [e.sample for entries in chunks for e in entries if e.sample.is_padding]:
        assert pad.is_padding and pad.input_ids == [PAD, PAD] and not any(pad.loss_mask)
        assert pad.isolation_key == ("r", "l") and pad.advantages == [0.0, 0.0]
    with pytest.raises(ValueError):
        padded_sample_count(3, dp_size=0, mini_batch_size=1)


def test_padding_never_makes_an_optimizer_step_of_pads_alone():
    """lcm(8, 256, 96) = 768: 1024 samples pad to 1536 = 6 mini-batches; each gets 170-171 real
    samples (not 4 full ones and 2 of pads), in input order, pads keyed like their neighbours."""
    samples = [make_sample([i % 200] * 3, lora_id="ab"[i // 512]) for i in range(1024)]
    plan = plan_step(
        samples, SPEC, StepShape(dp_size=8, mini_batch_size=256, critic_mini_batch_size=96, seq_len=64)
    )
    assert plan.num_padding_samples == 512 and len(plan.mini_batches) == 6
    real = [
        sorted(i for r in ranks for mb in r.micro_batches for i in mb.sample_indices)
        for ranks in plan.mini_batches
    ]
    assert [len(r) for r in real] == [171, 171, 171, 171, 170, 170]
    assert [i for r in real for i in r] == list(range(1024))
    assert all(n > 0 for n in plan.num_loss_tokens_per_mini_batch)
    for ranks, idx in zip(plan.mini_batches, real, strict=True):  # pads keyed like the last sample
        pad_loras = {
            mb.lora_id
            for r in ranks
            for mb in r.micro_batches
            for sl in mb.slots
            if (sl.sample_index or 0) >= 1024
        }
        assert pad_loras == {samples[idx[-1]].lora_id}
    one = plan_step(samples[:1], SPEC, StepShape(dp_size=3, mini_batch_size=4, seq_len=64))
    assert one.num_loss_tokens_per_mini_batch == [3, 0, 0]  # fewer real samples than steps: skip the zeros


def test_a_rank_without_an_image_gets_a_synthetic_pad_in_the_vision_slot(qwen2_vl_adapter):
    """dp 2, one image sample: slot 0 runs the vision tower on both ranks, so the rank whose bin
    holds only text gets a synthetic-image pad appended (the partition kept room for it); the stray
    placeholder sample gets a text slot, where the other rank runs a lone text pad."""
    spec = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD, adapter=qwen2_vl_adapter)
    grid = spec.image_pad_grid
    assert grid == (1, 4, 4)
    samples = [
        make_sample([1] * 3, [make_ref(2, 2)]),
        make_sample([2] * 40),
        make_sample([3] * 50),
        make_sample([4, TOK]),
    ]
    shape = StepShape(dp_size=2, mini_batch_size=4, seq_len=64)
    with pytest.raises(ValueError, match="needs the adapter"):
        plan_step(samples, SPEC, shape)
    (ranks,) = plan_step(samples, spec, shape).mini_batches
    layout = [[[s.sample_index for s in mb.slots] for mb in r.micro_batches] for r in ranks]
    assert layout == [[[0, 1], [None]], [[2, None], [3]]]
    assert [[mb.has_pixels for mb in r.micro_batches] for r in ranks] == [[True, False], [True, False]]
    mm = ranks[1].micro_batches[0]
    pad_slot = mm.slots[-1]
    assert pad_slot.is_padding and pad_slot.sample_index is None and pad_slot.num_loss_tokens == 0
    assert mm.images[-1].ref is None and mm.images[-1].grid == grid and mm.images[-1].length == 4
    assert mm.num_tokens == 53 + 6 <= 64  # [pad] + 4 placeholders + [pad]
    assert mm.micro_batch.mm_refs == []  # synthetic images have no ref on the wire
    assert mm.micro_batch.synthetic_grids == [list(grid)]
    assert_rebuilds(mm, spec)
    stray = ranks[1].micro_batches[1]
    assert stray.slots[0].stray_placeholders and not stray.has_pixels
    lone = ranks[0].micro_batches[1]  # the other rank's micro-batch of that text slot: a text pad
    assert lone.sample_count == 1 and lone.slots[0].is_padding and lone.num_loss_tokens == 0
    assert [r.num_samples for r in ranks] == [2, 2]


def test_step_plan_reports_each_rank_and_the_predicted_idle():
    """RankLoad per mini-batch and rank; sync_idle in tokens: 1 - work / (dp * sum of each slot's
    slowest rank), pads taking time without work. 53 + 43 + 13 + 12 tokens fit no 2 x 64-token
    slot: slot 0 holds the text (56 | 53), slot 1 the image sample and a lone image pad (6 | 12)."""
    samples = [
        make_sample([1] * 3, [make_ref(2, 2)]),
        make_sample([2] * 40),
        make_sample([3] * 50),
        make_sample([5] * 10),
    ]
    shape = StepShape(dp_size=2, mini_batch_size=4, seq_len=64)
    plan = plan_step(samples, FAKE, shape, refine=None)  # as constructed
    (ranks,) = plan.mini_batches
    assert [[mb.num_tokens for mb in r.micro_batches] for r in ranks] == [[56, 6], [53, 12]]
    loads = plan.rank_loads[0]
    assert [(x.micro_batches, x.tokens, x.padding_tokens, x.loss_tokens, x.vision_tokens) for x in loads] == [
        (2, 62, 6, 6, 0),
        (2, 65, 0, 6, 4),
    ]
    assert plan.sync_idle() == pytest.approx(1 - (56 + 53 + 12) / (2 * 56 + 2 * 12))
    assert plan.sync_idle(mini_batch=0) == plan.sync_idle()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_strategy(max_size=8))
def test_list_fast_path_agrees_with_the_numpy_path(samples):
    """locate_image_runs takes a C-level list path for lists and the numpy path otherwise: same answer."""
    for s in samples:
        refs = list(s.mm_refs.items) if s.mm_refs else []
        if not refs:
            continue
        types = s.mm_refs.mm_token_type_ids
        fast = locate_image_runs(s.input_ids, refs, TOK, mm_token_type_ids=types)
        slow = locate_image_runs(
            np.asarray(s.input_ids), refs, TOK, mm_token_type_ids=None if types is None else np.asarray(types)
        )
        assert fast == slow


def test_a_pad_with_a_loss_token_is_refused():
    """Pads are zero-loss and out of every count: a sample marked ``is_padding`` that carries a loss
    token (once trained on and counted in ``num_loss_tokens``) is refused."""
    real = make_sample([5, 6, 7])
    pad = msgspec.structs.replace(real, is_padding=True)  # a pad that kept the real sample's loss
    assert any(pad.loss_mask)
    with pytest.raises(ValueError, match="is a pad"):
        pack_samples([real, pad], SPEC, seq_len=64)
    quiet = msgspec.structs.replace(pad, loss_mask=[False] * len(pad.loss_mask))
    packed = pack_samples([real, quiet], SPEC, seq_len=64)
    assert packed.num_samples == 1 and packed.num_loss_tokens == sum(real.loss_mask)


# --- video segments (issue 44, part 3) ---------------------------------------------------------------

VIDEO_TOK = 262  # <|video_pad|> of the tiny models
VSPEC = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD, video_token_id=VIDEO_TOK)
"""No adapter, a video token: each video is one run of its ref's ``num_placeholders``."""


def _as_video(sample: TrainingSample) -> TrainingSample:
    """``sample`` with its images turned into videos (same runs, under the video token)."""
    refs = [
        msgspec.structs.replace(r, modality="video", media_type="video/mp4") for r in sample.mm_refs.items
    ]
    ids = [VIDEO_TOK if t == TOK else t for t in sample.input_ids]
    return msgspec.structs.replace(
        sample, input_ids=ids, mm_refs=msgspec.structs.replace(sample.mm_refs, items=refs)
    )


def test_video_spans_pack_type_2_and_round_trip():
    video = _as_video(make_sample([1, 2], [make_ref(2, 3), make_ref(1, 1, salt=1)]))
    image = make_sample([3], [make_ref(2, 2)], typed=True)
    text = make_sample([4, 5, 6])
    (mb,) = pack_samples([video, image, text], VSPEC, seq_len=4096).micro_batches
    assert [im.is_video for im in mb.images] == [True, True, False]
    assert mb.video_grids == [(1, 4, 6), (1, 2, 2)] and mb.image_grids == [(1, 4, 4)]
    ids, types = np.array(mb.micro_batch.input_ids), np.array(mb.mm_token_type_ids)
    assert np.array_equal(types == 2, ids == VIDEO_TOK) and np.array_equal(types == 1, ids == TOK)
    assert mb.micro_batch.images_per_sample == [2, 1, 0] and mb.placeholder_count == 6 + 1 + 4
    back = rebuild_micro_batch(decode_microbatch(encode(mb.micro_batch)), VSPEC)
    assert back.micro_batch == mb.micro_batch and back.images == mb.images


def test_video_refs_need_the_video_token_and_stray_video_tokens_stay_apart():
    video = _as_video(make_sample([1, 2], [make_ref(2, 3)]))
    with pytest.raises(ValueError, match="no video token id"):
        pack_samples([video], SPEC, seq_len=4096)
    stray = make_sample([1, VIDEO_TOK, 2])  # a literal <|video_pad|> in text
    assert pack_samples([video, stray], VSPEC, seq_len=4096).num_micro_batches == 2
    assert pack_samples([stray, make_sample([3])], VSPEC, seq_len=4096).num_micro_batches == 1
