"""``scripts/demo_rl.py``'s GRPO step on the tiny Qwen2-VL: the loss is averaged over the loss
tokens left after materializing, so a sample whose image is gone (zero loss under the default
``placeholder_zero_loss``) does not scale the others' loss down. And ``scripts/demo.py --video``
end to end (its own server)."""

from __future__ import annotations

import msgspec
import pytest

from helpers import PAD, TOK, photo_bytes, rollout_sample


@pytest.fixture(scope="module")
def model(qwen2_vl_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    from trainer_lib import prepare_model_for_packing

    m = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32)
    prepare_model_for_packing(m)
    return m


def test_a_missing_image_leaves_the_loss_of_the_others_unscaled(model, qwen2_vl_adapter, tmp_path):
    import torch

    from demo_rl import train_step
    from protocol.adapters import offload_image
    from protocol.refs import format_mmraw, parse_ref
    from trainer_lib import MaterializeConfig, PackingSpec

    root = tmp_path / "run_1" / "assets"
    good = offload_image(photo_bytes("coffee", size=(56, 56)), root, qwen2_vl_adapter)
    gone = (root / "images" / ("e" * 16 + ".jpg")).as_uri()
    body = msgspec.structs.replace(parse_ref(good.ref), raw_image_uri=gone, mm_hash="e" * 32)
    missing = msgspec.structs.replace(good, ref=format_mmraw(body))

    def sample(ref, completion: list[int]):
        prompt = [1, 259, *[TOK] * ref.num_placeholders, 260, 2]
        s = rollout_sample(prompt, completion, [-1.5] * len(completion), [ref])
        return msgspec.structs.replace(s, advantages=[1.0 if m else 0.0 for m in s.loss_mask])

    spec = PackingSpec.from_adapter(qwen2_vl_adapter, model, pad_token_id=PAD)
    config = MaterializeConfig(asset_root=root)  # placeholder_zero_loss (the default)
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # the same weights for both steps
    alone = train_step(model, frozen, [sample(good, [5, 6, 7, 8])], spec, config)
    both = [sample(good, [5, 6, 7, 8]), sample(missing, [9, 10, 11])]
    beside = train_step(model, frozen, both, spec, config)
    assert alone.loss == pytest.approx(beside.loss, rel=1e-5)  # once 4/7 of it


@pytest.mark.server
@pytest.mark.timeout(900)
def test_the_video_demo_runs_the_rl_loop_on_clips(tmp_path):
    """``scripts/demo.py --video`` (Qwen2.5-VL, its own server, 2 steps: the second has the
    control): rollouts by video ref, the chat route's prompt and greedy tokens for the same clip as
    a data URL, the trainer's video pixels equal to the server's, the mismatch within the bound
    and the previous weights' far above it (the demo exits non-zero otherwise; the report says it)."""
    import os
    import re
    import subprocess
    import sys

    from helpers import REPO

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "demo.py"),
            "--video",
            "--steps",
            "2",
            "--keep",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = proc.stdout[proc.stdout.index("=== mmref demo report ===") :]
    assert "qwen2_5_vl, float32" in report
    assert "same tokens and prompt tokens for 2/2 prompts" in report
    assert "16 samples' clips, 2 processed" in report and "max |diff| = 0.0" in report
    assert len(list((tmp_path / "run_demo" / "assets" / "videos").iterdir())) == 2  # each clip offloaded once
    current = [float(m) for m in re.findall(r"current weights\s+: max \|d\| \S+, mean \|d\| (\S+),", report)]
    control = [float(m) for m in re.findall(r"previous weights\s+: mean \|d\| (\S+)", report)]
    assert len(current) == 2 and max(current) <= 1e-4
    assert len(control) == 1 and control[0] > 1e-2
