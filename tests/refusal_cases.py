"""The requests the plugin refuses, one per refusal code, for ``test_rollout_client.py``: built with a
client's template and offloader against its asset store."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from helpers import photo_bytes
from protocol import errors
from protocol.features import feature_path
from protocol.refs import FileRef, format_mmfile, format_mmraw, parse_ref
from protocol.store import AssetStore
from rollout_client import Sampling

__all__ = ["REFUSALS", "refusal_case"]

SHORT = Sampling(temperature=1.0, max_tokens=8)


def _images_message(n: int) -> list[dict]:
    content = [*({"type": "image", "image": b""} for _ in range(n)), {"type": "text", "text": "What?"}]
    return [{"role": "user", "content": content}]


def _prompt(client, counts: list[int]) -> list[int]:
    pad = client.builder.placeholder_token_id
    ids = client.template.encode(
        client.template.render(_images_message(len(counts)), add_generation_prompt=True)
    )
    out, k = [], 0
    for t in ids:
        if t == pad:
            out += [pad] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


def _edited(ref, **changes) -> str:
    body = parse_ref(ref.ref)
    return format_mmraw(msgspec.structs.replace(body, **changes))


def _fresh(client, name: str, size: tuple[int, int]):
    return client.offloader.offload(photo_bytes(name, size=size))


def refusal_case(name: str, client, tmp_path, asset_root, max_image_bytes: int, store=None):
    """``(prompt_ids, refs, sampling, extra_body)`` of the request the plugin refuses with code ``name``
    (``max_image_bytes``: the server's ``MMREF_MAX_IMAGE_BYTES``; ``store``: the
    ``store_endpoints.KeyFaultStore`` among the server's ``MMREF_ASSET_ROOTS``)."""
    ref = _fresh(client, "astronaut", (280, 280))
    n = ref.num_placeholders
    body = parse_ref(ref.ref)
    if name == "invalid_ref":
        return _prompt(client, [n]), ["mmraw:!!not-base64"], SHORT, None
    if name == "outside_root":
        outside = tmp_path / "outside.jpg"
        outside.write_bytes(photo_bytes("astronaut", size=(280, 280)))
        return _prompt(client, [n]), [_edited(ref, raw_image_uri=outside.as_uri())], SHORT, None
    if name == "asset_not_found":
        gone = _fresh(client, "coffee", (281, 200))
        Path(parse_ref(gone.ref).raw_image_uri.removeprefix("file://")).unlink()
        return _prompt(client, [gone.num_placeholders]), [gone.ref], SHORT, None
    if name == "hash_mismatch":
        swapped = _fresh(client, "chelsea", (282, 200))
        Path(parse_ref(swapped.ref).raw_image_uri.removeprefix("file://")).write_bytes(photo_bytes("rocket"))
        return _prompt(client, [swapped.num_placeholders]), [swapped.ref], SHORT, None
    if name == "fingerprint_mismatch":
        return _prompt(client, [n]), [_edited(ref, fingerprint="f" * 32)], SHORT, None
    if name == "grid_mismatch":
        t, h, w = body.payload["image_grid_thw"]
        grid = [t, h + 2, w]
        claimed = _edited(ref, payload={"image_grid_thw": grid})
        return _prompt(client, [client.offloader.adapter.num_placeholders(grid)]), [claimed], SHORT, None
    if name == "placeholder_mismatch":
        return _prompt(client, [n - 1]), [ref.ref], SHORT, None
    if name == "unsupported_family":
        return _prompt(client, [n]), [_edited(ref, family="qwen2_5_vl")], SHORT, None
    if name == "image_unreadable":
        junk = b"not an image at all" * 50
        path = asset_root / "images" / "junk.jpg"
        path.write_bytes(junk)
        digest = hashlib.sha256(junk).hexdigest()[:32]
        return _prompt(client, [n]), [_edited(ref, raw_image_uri=path.as_uri(), mm_hash=digest)], SHORT, None
    if name == "asset_too_large":
        big = client.offloader.offload(photo_bytes("astronaut", fmt="PNG", size=(1024, 1024)))
        assert Path(parse_ref(big.ref).raw_image_uri.removeprefix("file://")).stat().st_size > max_image_bytes
        return _prompt(client, [big.num_placeholders]), [big.ref], SHORT, None
    if name == "corrupt_feature":
        ids = FileRef(
            run_id="1", fingerprint=client.offloader.adapter.fingerprint, modality="image", mm_hash="c" * 32
        )
        path = feature_path(asset_root, ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x93not a feature file")
        return _prompt(client, [n]), [format_mmfile(ids)], SHORT, None
    if name == "seed_unsupported":
        # split even alone: its two sequences of over 1100 tokens exceed the 2048-token step
        return _prompt(client, [n]), [ref.ref], Sampling(max_tokens=1100, seed=7, extra={"n": 2}), None
    if name == "store_unavailable":  # a v2 ref whose image is only behind a root that is down for it
        image = photo_bytes("coffee", size=(283, 200))
        lost = client.offloader.adapter.offload(image, AssetStore(tmp_path / "elsewhere"), form="v2")
        store.kill(lost.sha256)
        return _prompt(client, [lost.num_placeholders]), [lost.ref], SHORT, None
    if name == "invalid_request":
        features = {"mm_hashes": {}, "mm_placeholders": {}}
        return _prompt(client, [n]), [ref.ref], SHORT, {"features": features}
    raise AssertionError(name)


NOT_ON_GENERATE = (errors.NotCached, errors.UpdateConflict, errors.DrainTimeout)
"""``not_cached`` answers a ``null`` ``kwargs_data`` slot, which the client never sends (it sends every
image as a ref); ``update_conflict`` and ``drain_timeout`` are answers of the weight-update routes
(the client retries a 503 ``drain_timeout`` like any 503: tested with the fault proxy)."""
ON_VIDEO_SERVERS = (errors.VideoUnreadable,)
"""``video_unreadable`` answers a video ref, which this module's Qwen2-VL server has no path for (a
video ref is ``unsupported_family`` there): its cases run on the video families' servers
(``tests/test_server_video.py``)."""
REFUSALS = [cls for cls in errors.all_error_types() if cls not in (*NOT_ON_GENERATE, *ON_VIDEO_SERVERS)]
"""Every refusal the generate route can answer to the client."""
