"""trainer_lib.materialize on real photos and the real HF processor."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
import weakref

import msgspec
import pytest
import torch

from helpers import REPO, photo_bytes
from protocol.adapters import offload_image
from protocol.errors import (
    AssetNotFound,
    AssetOutsideRoot,
    AssetTooLarge,
    GridMismatch,
    PlaceholderMismatch,
    UnsupportedFamily,
)
from protocol.images import load_image
from protocol.refs import format_mmraw, parse_ref
from protocol.structs import MMRefs, TrainingSample
from trainer_lib import (
    MaterializeConfig,
    MaterializeOptions,
    PackingSpec,
    materialize,
    materialize_micro_batch,
    pack_samples,
)

TOK = 261  # <|image_pad|> of the tiny Qwen2-VL
STRICT = MaterializeOptions(policy="error")
TWO = MaterializeOptions(max_workers=2)
ONE = MaterializeOptions(max_workers=1)


def sample(refs, n_tokens: int = 12) -> TrainingSample:
    return TrainingSample(
        input_ids=list(range(n_tokens)),
        loss_mask=[True] * n_tokens,
        advantages=[1.0] * n_tokens,
        inference_logprobs=[-1.0] * n_tokens,
        mm_refs=MMRefs(items=list(refs)) if refs else None,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory, qwen2_vl_adapter):
    root = tmp_path_factory.mktemp("mat") / "run_7" / "assets"
    refs = {n: offload_image(photo_bytes(n), root, qwen2_vl_adapter) for n in ("astronaut", "coffee")}
    return root, refs


def test_sixteen_samples_sharing_two_images_process_two(store, qwen2_vl_adapter):
    root, refs = store
    a, b = refs["astronaut"], refs["coffee"]
    samples = [sample([a] if i % 2 else [b, a]) for i in range(16)]
    calls = []
    original = qwen2_vl_adapter.process

    def counting(image, **kw):
        calls.append(image.size)
        return original(image, **kw)

    qwen2_vl_adapter.process = counting
    try:
        batch = materialize(samples, qwen2_vl_adapter, root, TWO)  # dedup: the default
        per_slot = materialize(samples, qwen2_vl_adapter, root, TWO, dedup=False)
    finally:
        del qwen2_vl_adapter.process
    assert len(calls) == 4 and batch.stats.processed == 2 and batch.stats.unique_refs == 2
    assert batch.stats.images == 24 and batch.images_per_sample == [2 if i % 2 == 0 else 1 for i in range(16)]
    # every slot shows exactly what the processor gives for that image, in sample then prompt order
    expect = {n: qwen2_vl_adapter.process(load_image(photo_bytes(n))) for n in ("astronaut", "coffee")}
    order = [n for i in range(16) for n in (["astronaut"] if i % 2 else ["coffee", "astronaut"])]
    want = torch.cat([expect[n].tensors["pixel_values"] for n in order])
    assert torch.equal(per_slot.features["pixel_values"], want) and per_slot.image_index is None
    assert per_slot.features["image_grid_thw"].tolist() == [list(expect[n].grid) for n in order]
    # dedup: each distinct image once (first-seen order), image_index per slot
    assert batch.image_index.tolist() == [{"coffee": 0, "astronaut": 1}[n] for n in order]
    distinct = torch.cat([expect[n].tensors["pixel_values"] for n in ("coffee", "astronaut")])
    assert torch.equal(batch.features["pixel_values"], distinct)
    assert batch.features["pixel_values"].dtype == torch.float32  # normalized, as the HF model takes


def test_missing_image_placeholder_zero_loss_zeroes_only_that_sample(store, qwen2_vl_adapter, caplog):
    root, refs = store
    good = refs["coffee"]
    gone_uri = (root / "images" / "ffffffffffffffff.jpg").as_uri()
    missing = msgspec.structs.replace(good, ref=format_mmraw(
        msgspec.structs.replace(parse_ref(good.ref), raw_image_uri=gone_uri, mm_hash="f" * 32)
    ))  # fmt: skip
    samples = [sample([good]), sample([missing, good]), sample([])]
    with caplog.at_level(logging.WARNING, logger="trainer_lib.materialize"):
        batch = materialize(samples, qwen2_vl_adapter, root)
    (record,) = caplog.records  # one WARNING per batch: by code, slots, zeroed samples, the root
    assert (
        "1 distinct image(s) replaced" in record.getMessage() and "asset_not_found 1" in record.getMessage()
    )
    assert "loss zeroed for 1 of 3 sample(s)" in record.getMessage() and str(root) in record.getMessage()
    assert batch.stats.failed_by_code == {"asset_not_found": 1}
    assert batch.placeholder_refs == [missing.ref]
    assert batch.stats.placeholders == 1 and batch.stats.zeroed_samples == 1
    assert [any(s.loss_mask) for s in batch.samples] == [True, False, True]
    n_good = good.grid[0] * good.grid[1] * good.grid[2]
    pv = materialize(samples, qwen2_vl_adapter, root, dedup=False).features["pixel_values"]
    assert pv.shape == (3 * n_good, 3 * 2 * 14 * 14)
    assert torch.count_nonzero(pv[n_good : 2 * n_good]) == 0  # the placeholder: zeros of the ref's grid
    assert torch.equal(pv[:n_good], pv[2 * n_good :])
    assert batch.features["image_grid_thw"].tolist() == [list(good.grid)] * 2  # good, the stand-in
    assert batch.image_index.tolist() == [0, 1, 0]

    with pytest.raises(AssetNotFound) as info:
        materialize(samples, qwen2_vl_adapter, root, STRICT)
    assert info.value.ref == missing.ref and f"trainer asset roots checked: {root}" in info.value.message


def test_the_steps_cache_and_a_stand_in_fill_the_dedup_features(store, qwen2_vl_adapter):
    """Each distinct image lands once in the collated features whether this call processes it, an
    earlier call of the step did (``resolved``), or zeros stand in for it."""
    root, refs = store
    a, b = refs["astronaut"], refs["coffee"]
    gone_uri = (root / "images" / "eeeeeeeeeeeeeeee.jpg").as_uri()
    missing = msgspec.structs.replace(b, ref=format_mmraw(
        msgspec.structs.replace(parse_ref(b.ref), raw_image_uri=gone_uri, mm_hash="e" * 32)
    ))  # fmt: skip
    resolved: dict = {}
    materialize([sample([a])], qwen2_vl_adapter, root, resolved=resolved)
    assert list(resolved) == [a.ref] and resolved[a.ref].grid == tuple(a.grid)  # the cache keeps it
    batch = materialize(
        [sample([b, a]), sample([missing]), sample([a])], qwen2_vl_adapter, root, resolved=resolved
    )
    assert batch.stats.processed == 1 and set(resolved) == {a.ref, b.ref, missing.ref}
    expect = {n: qwen2_vl_adapter.process(load_image(photo_bytes(n))) for n in ("astronaut", "coffee")}
    zeros = torch.zeros(expect["coffee"].tensors["pixel_values"].shape)
    want = torch.cat(
        [expect["coffee"].tensors["pixel_values"], expect["astronaut"].tensors["pixel_values"], zeros]
    )
    assert torch.equal(batch.features["pixel_values"], want)
    assert batch.features["image_grid_thw"].tolist() == [list(b.grid), list(a.grid), list(b.grid)]
    assert batch.image_index.tolist() == [0, 1, 2, 1]


def test_a_failing_call_leaves_nothing_running_on_the_kept_pool(store, qwen2_vl_adapter):
    """Under ``policy="error"`` the first ref fails at once: the call's queued images are cancelled
    and those in flight finish before the error propagates (nothing of it runs on after)."""
    root, _ = store
    names = ("astronaut", "coffee", "chelsea", "rocket", "astronaut", "coffee")
    refs = [
        offload_image(photo_bytes(n, size=(64 + 8 * k, 48)), root, qwen2_vl_adapter)
        for k, n in enumerate(names)
    ]
    gone_uri = (root / "images" / "dddddddddddddddd.jpg").as_uri()
    missing = msgspec.structs.replace(refs[0], ref=format_mmraw(
        msgspec.structs.replace(parse_ref(refs[0].ref), raw_image_uri=gone_uri, mm_hash="d" * 32)
    ))  # fmt: skip
    started, finished = [], []
    original = qwen2_vl_adapter.process

    def slow(image, **kw):
        started.append(image.size)
        time.sleep(0.2)
        finished.append(image.size)
        return original(image, **kw)

    qwen2_vl_adapter.process = slow
    try:
        with pytest.raises(AssetNotFound):
            materialize([sample([r]) for r in [missing, *refs]], qwen2_vl_adapter, root, STRICT)
        seen = (len(started), len(finished))
        time.sleep(0.6)
        assert (len(started), len(finished)) == seen and seen[0] == seen[1] < len(refs)
    finally:
        del qwen2_vl_adapter.process


def test_without_a_cache_each_image_is_freed_once_written(store, qwen2_vl_adapter):
    """dedup: each processed image's own tensors are freed as soon as they are copied into the
    features, before the next image is processed (peak memory one collated copy plus the images in
    flight), and kept when the step's ``resolved`` cache asks for them."""
    root, refs = store
    samples = [sample([refs["coffee"]]), sample([refs["astronaut"]]), sample([refs["coffee"]])]
    made: list[weakref.ref] = []
    alive_before: list[int] = []  # earlier images still held when each image is processed
    original = qwen2_vl_adapter.process

    def tracked(image, **kw):
        alive_before.append(sum(r() is not None for r in made))
        out = original(image, **kw)
        made.append(weakref.ref(out.tensors["pixel_values"]))
        return out

    qwen2_vl_adapter.process = tracked
    try:
        batch = materialize(samples, qwen2_vl_adapter, root, ONE)
        assert alive_before == [0, 0] and all(r() is None for r in made)
        made.clear()
        alive_before.clear()
        resolved: dict = {}
        kept = materialize(samples, qwen2_vl_adapter, root, ONE, resolved=resolved)
        assert alive_before == [0, 1] and all(r() is not None for r in made) and len(resolved) == 2
        assert torch.equal(kept.features["pixel_values"], batch.features["pixel_values"])
    finally:
        del qwen2_vl_adapter.process


def test_a_forked_child_gets_its_own_pool(store, qwen2_vl_adapter):
    """The pool is kept per process: a child forked after the parent used it (a fork-started data
    loader worker) resolves on threads of its own instead of waiting on the parent's."""
    root, refs = store
    samples = [sample([refs["coffee"]]), sample([refs["astronaut"]])]
    want = materialize(samples, qwen2_vl_adapter, root, TWO).features["pixel_values"]

    def child(queue):
        torch.set_num_threads(1)
        got = materialize(samples, qwen2_vl_adapter, root, TWO).features["pixel_values"]
        queue.put(bool(torch.equal(got, want)))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0 and queue.get(timeout=5)


def test_errors_speak_of_the_adapter_and_the_roots(store, qwen2_vl_adapter, tmp_path):
    root, refs = store
    body = parse_ref(refs["coffee"].ref)
    other = msgspec.structs.replace(
        refs["coffee"], ref=format_mmraw(msgspec.structs.replace(body, family="qwen2_5_vl"))
    )
    with pytest.raises(UnsupportedFamily, match="not the adapter's family 'qwen2_vl'"):
        materialize([sample([other])], qwen2_vl_adapter, root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(AssetOutsideRoot, match=f"roots checked: {elsewhere}"):
        materialize([sample([refs["coffee"]])], qwen2_vl_adapter, elsewhere)


def test_refs_outside_the_root_always_raise(store, qwen2_vl_adapter, tmp_path):
    _, refs = store
    other_root = tmp_path / "elsewhere"
    other_root.mkdir()
    with pytest.raises(AssetOutsideRoot):
        materialize([sample([refs["coffee"]])], qwen2_vl_adapter, other_root)


def test_bad_arguments(store, qwen2_vl_adapter):
    root, _ = store
    with pytest.raises(ValueError, match="policy"):  # checked when the options are made
        MaterializeOptions(policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_workers"):
        MaterializeOptions(max_workers=0)
    assert materialize([sample([])], qwen2_vl_adapter, root).features == {}


def test_materialize_and_packing_refuse_the_same_prompts_the_same_way(store, qwen2_vl_adapter):
    """One placeholder check (protocol.placeholders): materialize with
    ``MaterializeOptions(placeholder_token_id=...)`` and pack_samples raise the same
    PlaceholderMismatch for the same prompt, and accept the same ones: a text-only sample holding
    the placeholder id as text (a stray placeholder) included."""
    root, refs = store
    good = refs["coffee"]
    tok, n = 261, good.num_placeholders

    def prompt(ids, types=None, ref=good):
        return TrainingSample(
            input_ids=ids,
            loss_mask=[False] * len(ids),
            advantages=[0.0] * len(ids),
            inference_logprobs=[0.0] * len(ids),
            mm_refs=MMRefs(items=[ref] if ref else [], mm_token_type_ids=types) if ref or types else None,
        )

    bad = [
        prompt([1, *[tok] * (n - 1), 2]),  # one placeholder short
        prompt([tok, 1, *[tok] * n]),  # one too many
        prompt([1, *[tok] * n], [0] * (n + 1)),  # image tokens typed as text
        prompt([tok, *[tok] * n], [0] + [1] * n),  # a placeholder-id text token beside the image
        prompt(
            [1, *[tok] * (n + 4)], ref=msgspec.structs.replace(good, num_placeholders=n + 4)
        ),  # lying count
        prompt([1, tok, 2, 3], [0, 1, 0, 0], ref=None),  # an image-typed token without images
    ]
    spec = PackingSpec(placeholder_token_id=tok, pad_token_id=0, adapter=qwen2_vl_adapter)
    checked = MaterializeOptions(placeholder_token_id=tok)
    for s in bad:
        with pytest.raises(PlaceholderMismatch) as packed:
            pack_samples([s], spec, seq_len=4096)
        with pytest.raises(PlaceholderMismatch) as materialized:
            materialize([s], qwen2_vl_adapter, root, checked)
        assert str(materialized.value) == str(packed.value) and materialized.value.ref == packed.value.ref
    ok = prompt([1, *[tok] * n, 2])
    assert materialize([ok], qwen2_vl_adapter, root, checked).stats.images == 1
    assert (
        pack_samples([ok], PackingSpec(placeholder_token_id=tok, pad_token_id=0), seq_len=4096).num_samples
        == 1
    )
    stray = [prompt([1, tok, 2, 3], ref=None), prompt([1, tok, 2, 3], [0, 0, 0, 0], ref=None)]
    for s in stray:  # packed apart from pixels, never a reason to kill the step
        step = pack_samples([s, ok], spec, seq_len=4096)
        (mb,) = [mb for mb in step.micro_batches if any(x.sample_index == 0 for x in mb.slots)]
        assert [x.stray_placeholders for x in mb.slots] == [True] and not mb.images
        assert step.num_samples == 2
        assert materialize([s, ok], qwen2_vl_adapter, root, checked).stats.images == 1


def packable(ref) -> TrainingSample:
    """``[1] + image placeholders + [2, 3]``, loss on the last two tokens."""
    ids = [1, *[TOK] * ref.num_placeholders, 2, 3]
    n = len(ids)
    return TrainingSample(
        input_ids=ids,
        loss_mask=[False] * (n - 2) + [True, True],
        advantages=[0.0] * n,
        inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=[ref]),
    )


def test_materialize_micro_batch_takes_every_materialize_setting(store, qwen2_vl_adapter, monkeypatch):
    """materialize_micro_batch takes the MaterializeConfig, and its limits apply; the pixel mode
    is the spec's."""
    root, refs = store
    s = packable(refs["coffee"])
    spec = PackingSpec(placeholder_token_id=TOK, pad_token_id=0, adapter=qwen2_vl_adapter)
    (mb,) = pack_samples([s], spec, seq_len=4096).micro_batches
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(root))
    for name, value in (("MMREF_MAX_IMAGE_BYTES", "1000"), ("MMREF_MAX_IMAGE_PIXELS", "100")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            env.setenv("MMREF_MISSING_POLICY", "error")
            with pytest.raises(AssetTooLarge):
                materialize_micro_batch(mb, spec, MaterializeConfig())
            env.setenv("MMREF_MISSING_POLICY", "placeholder_zero_loss")
            m = materialize_micro_batch(mb, spec, MaterializeConfig())
            assert m.stats.placeholders == 1 and m.packed.num_loss_tokens == 0, name
    m = materialize_micro_batch(mb, spec, MaterializeConfig())
    assert m.stats.placeholders == 0 and m.packed.num_loss_tokens == 2
    raw_spec = PackingSpec(
        placeholder_token_id=TOK, pad_token_id=0, adapter=qwen2_vl_adapter, raw_pixels=True
    )
    raw = materialize_micro_batch(mb, raw_spec, MaterializeConfig()).features["pixel_values"]
    raw_options = MaterializeOptions(raw_pixels=True)
    want = materialize([s], qwen2_vl_adapter, root, raw_options).features["pixel_values"]
    assert torch.equal(raw, want) and not torch.equal(raw, m.features["pixel_values"])


CLAIMED_GRID = textwrap.dedent("""
    import resource, sys
    import msgspec
    from protocol.adapters import load_adapter
    from protocol.errors import GridMismatch
    from protocol.refs import format_mmraw, parse_ref
    from protocol.structs import MMRefs, RawMMRef, TrainingSample
    from trainer_lib import MaterializeOptions, materialize

    model, ref_string, root = sys.argv[1:]
    adapter = load_adapter(model)
    body = parse_ref(ref_string)
    payload = {"image_grid_thw": [1, 512, 512]}  # 1.15 GiB of float32 zeros if anything sized it
    forged = format_mmraw(msgspec.structs.replace(body, payload=payload, mm_hash="e" * 32))
    ref = RawMMRef(ref=forged, sha256="e" * 64, media_type="image/jpeg", grid=[1, 512, 512],
                   num_placeholders=65536)
    sample = TrainingSample(input_ids=[1, 2], loss_mask=[False, True], advantages=[0.0, 0.0],
                            inference_logprobs=[0.0, 0.0], mm_refs=MMRefs(items=[ref]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for policy in ("placeholder_zero_loss", "error"):
        try:
            materialize([sample], adapter, root, MaterializeOptions(policy=policy))
        except GridMismatch as e:
            assert e.ref == forged
        else:
            raise AssertionError(policy)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
""")


def test_a_claimed_grid_is_bounded_before_any_stand_in_is_sized(store, qwen2_vl_dir):
    """A missing image whose ref claims [1, 512, 512]: a typed GridMismatch under both policies, and
    no zero stand-in sized by the claim (peak RSS grows by less than 64 MiB, not 1.15 GiB)."""
    root, refs = store
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", CLAIMED_GRID, str(qwen2_vl_dir), refs["coffee"].ref, str(root)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 64 * 1024  # KiB


def test_a_synthetic_grid_is_bounded_before_its_zeros_are_sized(store, qwen2_vl_adapter):
    """Synthetic pad images (a balance setting, or synthetic_grids off the wire) are bounded by the
    adapter's grid limits before zero_features sizes zeros for them."""
    from trainer_lib.planning.packing import PackEntry, build_micro_batch, rebuild_micro_batch
    from trainer_lib.planning.padding import make_pad_sample
    from trainer_lib.planning.plan import plan_step
    from trainer_lib.planning.ranks import StepShape

    root, refs = store
    config = MaterializeConfig(asset_root=root)
    axes, _ = qwen2_vl_adapter.grid_limits()
    huge = (1, 2, 2 * axes[2])  # one axis over the processor's limit
    spec = PackingSpec(placeholder_token_id=TOK, pad_token_id=0, adapter=qwen2_vl_adapter)
    pad = make_pad_sample(spec, grid=huge)
    wire = build_micro_batch([PackEntry(packable(refs["coffee"]), 0), pad], spec).micro_batch
    mb = rebuild_micro_batch(wire, spec)
    with pytest.raises(GridMismatch, match="exceeds"):
        materialize_micro_batch(mb, spec, config)
    text_only = TrainingSample(
        input_ids=[1, 2, 3], loss_mask=[False, True, True], advantages=[0.0] * 3, inference_logprobs=[0.0] * 3
    )
    step = [packable(refs["coffee"]), text_only]
    shape = StepShape(dp_size=2, mini_batch_size=2, seq_len=4096)
    with pytest.raises(GridMismatch, match="exceeds"):
        plan_step(step, PackingSpec(TOK, 0, qwen2_vl_adapter, synthetic_grid=huge), shape)
    (ranks,) = plan_step(
        step, PackingSpec(TOK, 0, qwen2_vl_adapter, synthetic_grid=(1, 4, 4)), shape
    ).mini_batches
    padded = next(mb for r in ranks for mb in r.micro_batches if mb.sample_indices == [1])
    assert padded.images[-1].ref is None and padded.images[-1].grid == (1, 4, 4)
    assert materialize_micro_batch(padded, spec, config).stats.images == 0


def test_offloading_again_repairs_a_damaged_image(qwen2_vl_adapter, tmp_path):
    """A truncated stored image makes its samples zero-loss; offloading the original bytes again
    (same ref) rewrites the file, and the same samples train again."""
    root = tmp_path / "run_2" / "assets"
    jpeg = photo_bytes("rocket")
    ref = offload_image(jpeg, root, qwen2_vl_adapter)
    path = parse_ref(ref.ref).raw_image_uri.removeprefix("file://")
    with open(path, "r+b") as f:
        f.truncate(1000)
    assert materialize([packable(ref)], qwen2_vl_adapter, root).stats.zeroed_samples == 1
    assert offload_image(jpeg, root, qwen2_vl_adapter) == ref
    batch = materialize([packable(ref)], qwen2_vl_adapter, root, STRICT)
    assert batch.stats.processed == 1 and any(batch.samples[0].loss_mask)
