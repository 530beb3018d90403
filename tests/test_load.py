"""Bounded loopback load test against the real server: 0 5xx, every valid request answered, RSS bounded."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from helpers import SERVER_CACHE_BUDGET
from load_test import run_load
from protocol.refs import format_mmraw, parse_ref

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]
PAD = 261
GREEDY = {"temperature": 0, "max_tokens": 2}


def test_500_mixed_requests_16_concurrent(server, photo_refs, asset_root):
    images = [photo_refs[n] for n in ("astronaut", "coffee", "chelsea", "rocket")]
    cases: list[tuple[dict, int]] = []
    for ref in images:
        prompt = [1, 2, *([PAD] * ref.num_placeholders), 3]
        body = parse_ref(ref.ref)
        valid = {"token_ids": prompt, "mm_refs": [msgspec.to_builtins(ref)], "sampling_params": GREEDY}
        cases += [(valid, 200)] * 6  # repeated images, as in RL groups
        forged = msgspec.structs.replace(body, mm_hash="9" * 32)
        traversal = msgspec.structs.replace(
            body, raw_image_uri=body.raw_image_uri.rsplit("/", 1)[0] + "/../../../../../../etc/hostname"
        )
        missing = msgspec.structs.replace(body, raw_image_uri=(asset_root / "images" / "0123.jpg").as_uri())
        cases += [
            ({**valid, "mm_refs": [format_mmraw(forged)]}, 409),
            ({**valid, "mm_refs": [format_mmraw(traversal)]}, 403),
            ({**valid, "mm_refs": [format_mmraw(missing)]}, 404),
            ({**valid, "token_ids": prompt[:-3]}, 422),
        ]
    report = asyncio.run(
        run_load(server.url, cases, requests=500, concurrency=16, server_pid=server.process.pid)
    )
    print(report.summary())
    assert report.server_errors == 0
    assert not report.unexpected, report.unexpected[:5]
    assert sum(report.statuses.values()) == 500
    assert report.rss_after - report.rss_before < SERVER_CACHE_BUDGET + (256 << 20), report.summary()
