"""Placeholder arithmetic of ``protocol.placeholders``: ``locate_image_runs``, ``locate_video_runs``
and ``expand_image_placeholders`` (ranges: ``tests/test_placeholder_ranges.py``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import InvalidRequest, PlaceholderMismatch
from protocol.placeholder_counts import video_token_runs
from protocol.placeholder_ranges import check_range
from protocol.placeholders import expand_image_placeholders, locate_image_runs, locate_video_runs
from protocol.structs import RawMMRef

P = 261  # <|image_pad|> of the tiny Qwen models
T = 7  # some text token


def ref(n: int) -> RawMMRef:
    return RawMMRef(
        ref="mmraw:" + "A" * 40,
        sha256="ab" * 32,
        media_type="image/png",
        grid=[1, 2, 2 * n],
        num_placeholders=n,
    )


# --- locate_image_runs --------------------------------------------------------------------------


def test_adjacent_images_in_one_run_are_split_by_counts():
    ids = [T, P, P, P, P, P, T]
    assert locate_image_runs(ids, [], P, counts=[2, 3]) == [(1, 2), (3, 3)]
    assert locate_image_runs(ids, [], P, counts=[3, 2]) == [(1, 3), (4, 2)]
    assert locate_image_runs(ids, [], P, counts=[1, 1, 1, 1, 1]) == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]


def test_images_in_separate_runs():
    ids = [P, P, T, T, P, P, P, T, P]
    assert locate_image_runs(ids, [], P, counts=[2, 3, 1]) == [(0, 2), (4, 3), (8, 1)]


def test_mixed_runs():
    ids = [T, P, P, P, T, P, P]
    assert locate_image_runs(ids, [], P, counts=[1, 2, 2]) == [(1, 1), (2, 2), (5, 2)]


# --- locate_video_runs (issue 44, part 3) ---------------------------------------------------------

V = 262  # <|video_pad|> of the tiny Qwen models


def test_video_runs_one_per_video_or_one_per_temporal_patch():
    ids = [T, V, V, V, T, V, V]
    assert locate_video_runs(ids, [], V, runs=[[3], [2]]) == [[(1, 3)], [(5, 2)]]
    assert locate_video_runs(ids, [], V, runs=[[3, 2]]) == [[(1, 3), (5, 2)]]  # Qwen3-VL: text between
    assert video_token_runs([2, 2, 6], 2, per_frame=True) == [3, 3]
    assert locate_video_runs([T, V, V, V, V], [], V, runs=[[2], [2]]) == [[(1, 2)], [(3, 2)]]  # adjacent


def test_video_runs_read_type_2_beside_images():
    ids = [T, P, P, T, V, V, V, T]
    types = [0, 1, 1, 0, 2, 2, 2, 0]
    assert locate_video_runs(ids, [], V, runs=[[3]], mm_token_type_ids=types) == [[(4, 3)]]
    assert locate_image_runs(ids, [], P, mm_token_type_ids=types, counts=[2]) == [(1, 2)]
    with pytest.raises(PlaceholderMismatch, match="typed as text"):  # a video token typed as text
        locate_video_runs(ids, [], V, runs=[[2]], mm_token_type_ids=[0, 1, 1, 0, 0, 2, 2, 0])
    with pytest.raises(PlaceholderMismatch, match="needing 4"):
        locate_video_runs(ids, [], V, runs=[[4]])


def test_no_images_no_placeholders():
    assert locate_image_runs([T, T, T], [], P, counts=[]) == []
    assert locate_image_runs([], [], P, counts=[]) == []


@pytest.mark.parametrize(
    ("ids", "counts", "found"),
    [
        ([T, P, P, P, T], [2, 2], 3),  # too few
        ([T, P, P, P, P, P, T], [2, 2], 5),  # too many
        ([T, T, T], [4], 0),  # none
        ([T, P, P], [], 2),  # placeholders without images
    ],
)
def test_count_mismatch_names_token_and_counts(ids, counts, found):
    with pytest.raises(PlaceholderMismatch) as info:
        locate_image_runs(ids, [], P, counts=counts)
    message = str(info.value)
    assert f"id {P}" in message
    assert f"{found} image placeholder" in message
    assert str(sum(counts)) in message
    assert info.value.code == "placeholder_mismatch"
    assert info.value.http_status == 422


@pytest.mark.parametrize(
    ("ids", "counts"),
    [
        ([P, P, T, P, P], [1, 3]),  # image 1 would take the last of run 0 and two of run 1
        ([P, P, T, P, P], [3, 1]),  # image 0 is longer than its run
        ([P, P, P, T, P], [2, 2]),
        ([P, T, P, T, P], [3]),
    ],
)
def test_image_spanning_two_runs_is_refused(ids, counts):
    assert sum(1 for t in ids if t == P) == sum(counts)  # totals agree; only the split is wrong
    with pytest.raises(PlaceholderMismatch, match="placeholder tokens"):
        locate_image_runs(ids, [], P, counts=counts)


# --- expand_image_placeholders ----------------------------------------------------------------


def test_expand_repeats_each_placeholder_by_its_count():
    ids = [T, P, 8, P, 9]
    assert expand_image_placeholders(ids, [ref(2), ref(3)], P) == [T, P, P, 8, P, P, P, 9]


def test_expand_adjacent_placeholders():
    assert expand_image_placeholders([P, P], [ref(1), ref(4)], P) == [P] * 5


def test_expand_without_images_returns_a_copy():
    ids = [T, 8, 9]
    out = expand_image_placeholders(ids, [], P)
    assert out == ids
    assert out is not ids


@pytest.mark.parametrize(("ids", "n_refs", "found"), [([T, P, P], 1, 2), ([T, P], 2, 1), ([T], 1, 0)])
def test_expand_count_mismatch(ids, n_refs, found):
    with pytest.raises(PlaceholderMismatch) as info:
        expand_image_placeholders(ids, [ref(2)] * n_refs, P)
    message = str(info.value)
    assert f"{found} placeholder tokens (id {P})" in message
    assert f"{n_refs} image" in message


# --- property: expand then locate round-trips -------------------------------------------------

text_token = st.integers(0, 511).filter(lambda t: t != P)


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(1, 40), min_size=0, max_size=6),
    texts=st.lists(st.lists(text_token, max_size=5), min_size=7, max_size=7),
)
def test_expand_then_locate_round_trips(counts, texts):
    prompt: list[int] = list(texts[0])
    where: list[int] = []  # where each image's run will start in the expanded prompt
    expanded_len = len(prompt)
    for i, n in enumerate(counts):
        prompt.append(P)
        where.append(expanded_len)
        expanded_len += n
        prompt.extend(texts[i + 1])  # may be empty: adjacent images merge into one run
        expanded_len += len(texts[i + 1])

    expanded = expand_image_placeholders(prompt, [ref(n) for n in counts], P)
    assert len(expanded) == expanded_len
    ranges = locate_image_runs(expanded, [], P, counts=counts)

    assert ranges == list(zip(where, counts, strict=True))
    assert [n for _, n in ranges] == list(counts)
    assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in itertools.pairwise(ranges))
    covered = {o + k for o, n in ranges for k in range(n)}
    assert covered == {i for i, t in enumerate(expanded) if t == P}
    for (offset, n), count in zip(ranges, counts, strict=True):
        assert expanded[offset : offset + n] == [P] * n
        check_range(expanded, {"offset": offset, "length": n}, P, count, "r")


@pytest.mark.parametrize("big", [2**63, 2**64 + 5, -(2**63) - 1])
def test_an_id_beyond_64_bits_is_a_typed_refusal(big):
    """A JSON integer beyond int64 inside a placeholder run (numpy cannot hold it): a typed 400,
    never the interpreter's ``OverflowError`` text."""
    ids = [T, P, P, big, P, T]
    with pytest.raises(InvalidRequest, match="outside the 64-bit integer range"):
        locate_image_runs(ids, [], P, counts=[4])


def test_a_refusal_body_escapes_lone_surrogates():
    """A ref with a lone surrogate (valid in a JSON string, not in UTF-8) is echoed escaped, so the
    error body can be encoded (it was a 400 with the encoder's exception text)."""
    import json

    from protocol.errors import InvalidRef
    from vllm_plugin.protocol import error_body

    body = error_body(InvalidRef("bad ref \ud800", ref="mmraw:x\ud800"), "bad ref \ud800")
    encoded = json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert body["error"]["ref"] == "mmraw:x\\ud800" and b"\\\\ud800" in encoded
