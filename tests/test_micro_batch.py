"""trainer_lib.micro_batch: the wire struct built on first read (issue 43), counts from the slots."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import pytest

from helpers import FAKE, make_ref, make_sample
from protocol.structs import MicroBatch
from trainer_lib.micro_batch import PackedMicroBatch, replace_loss_mask, wire_struct
from trainer_lib.planning.packing import PackEntry, build_micro_batch
from trainer_lib.planning.padding import make_pad_sample
from trainer_lib.planning.plan import plan_step
from trainer_lib.planning.ranks import StepShape


def _packed() -> PackedMicroBatch:
    refs = [make_ref(2, 2), make_ref(1, 3, 1)]
    samples = [make_sample([1] * 5, refs, lora_id="a"), make_sample([2] * 7, lora_id="a")]
    pad = make_pad_sample(FAKE, ("", "a"), grid=(1, 4, 4))
    return build_micro_batch([PackEntry(samples[0], 0), PackEntry(samples[1], 1), pad], FAKE)


def test_the_wire_struct_is_built_on_first_read_and_kept():
    packed = _packed()
    assert packed.__dict__.get("_wire") is None  # not built by packing
    counts = (packed.num_tokens, packed.seq_lens, packed.sample_count, packed.run_id, packed.lora_id)
    assert packed.__dict__.get("_wire") is None  # the counts read the slots
    mb = packed.micro_batch
    assert packed.micro_batch is mb  # built once
    assert counts == (len(mb.input_ids), mb.seq_lens, mb.sample_count, mb.run_id, mb.lora_id)
    assert counts[1:4] == ([5 + (4 + 2) + (3 + 2) + 3, 7 + 3, 1 + 4 + 1], 3, "")
    samples = [s.sample for s in packed.slots]
    assert mb.input_ids == list(itertools.chain.from_iterable(s.input_ids for s in samples))
    assert mb.loss_mask == list(itertools.chain.from_iterable(s.loss_mask for s in samples))
    assert mb.advantages == list(itertools.chain.from_iterable(s.advantages for s in samples))
    assert mb.inference_logprobs == list(itertools.chain.from_iterable(s.inference_logprobs for s in samples))
    assert mb.mm_token_type_ids.count(1) == packed.placeholder_count == 4 + 3 + 4
    assert mb.synthetic_grids == [[1, 4, 4]] and mb.is_padding == [False, False, True]
    assert mb == wire_struct(packed.slots, packed.images)


def test_a_given_wire_struct_is_kept_as_given():
    packed = _packed()
    given = msgspec.structs.replace(packed.micro_batch, advantages=[9.0] * packed.num_tokens)
    again = PackedMicroBatch(slots=packed.slots, images=packed.images, micro_batch=given)
    assert again.micro_batch is given
    assert dataclasses.replace(packed, micro_batch=given).micro_batch is given
    mask = [False] * packed.num_tokens
    assert replace_loss_mask(packed, mask).micro_batch.loss_mask == mask
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed.micro_batch = given  # type: ignore[misc]


def test_plan_step_builds_no_wire_struct_until_a_rank_reads_its_own():
    refs = [make_ref(2, 2, k) for k in range(6)]
    samples = [make_sample([1] * (5 + k), refs[k % 6 : k % 6 + 1], completion=20 + k) for k in range(24)]
    shape = StepShape(dp_size=4, mini_batch_size=12, seq_len=512, micro_batch_max_tokens=128)
    plan = plan_step(samples, FAKE, shape)
    every = [mb for ranks in plan.mini_batches for share in ranks for mb in share.micro_batches]
    assert plan.num_tokens == sum(len(s.input_ids) for s in samples) + sum(
        s.length for mb in every for s in mb.slots if s.is_padding
    )
    plan.rank_loads, plan.sync_idle()  # the reports read slots only
    assert all(mb.__dict__.get("_wire") is None for mb in every)
    own = [mb.micro_batch for ranks in plan.mini_batches for mb in ranks[1].micro_batches]
    assert all(isinstance(w, MicroBatch) for w in own)
    built = [mb for mb in every if mb.__dict__.get("_wire") is not None]
    assert len(built) == len(own) < len(every)
