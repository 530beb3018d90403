"""TRL's stock VLM GRPO path vs TRL with mmref, side by side in one run on the same rows and server.

Both run TRL's own ``GRPOTrainer`` (same tiny model, dataset of real photos, reward, seed) against
one mmref server (``--enable-scale-out``, dev mode), ``--steps`` optimizer steps each:

- **stock**: ``GRPOTrainer`` whose ``rollout_func`` does what TRL's server mode does for a VLM
  (``VLLMGeneration.generate``, trl/generation/vllm_generation.py:593-650): TRL's ``VLLMClient``
  renders each prompt's images (``/v1/chat/completions/render``: the image as a PNG data URL up,
  the processed pixels down), TRL places the features on the prompt's image tokens and posts the
  token ids with the pixels inline to ``/inference/v1/generate`` (``n`` = group size; the body of
  ``VLLMClient._generate_from_features``, posted here because TRL 1.16 cannot parse vLLM 0.32's
  tokens-mode logprobs). Then TRL's own batch: its processor over every row's images
  (grpo_trainer.py:2536) and its padded forward. TRL's server mode itself cannot start on a CPU
  (its NCCL weight sync raises for non-CUDA devices), so the weights go through the plugin's
  update route, as for mmref.
- **mmref**: :class:`integrations.trl.MMRefGRPOTrainer` (rollouts by ref, the batch from
  ``trainer_lib``).

Per step: bytes sent to and from the rollout engine (HTTP bodies, both directions), bytes of image
input the trainer's forward took (stock: TRL's ``pixel_values`` of every row; mmref: each distinct
image once per micro-batch), and step time (generation + loss + optimizer + push). CPU figures
are informational (2 shared cores, tiny model: ``max_pixels`` 112*112); run the same script on a
lent GPU for real ones.

Usage: ``.venv/bin/python bench/trl_grpo.py [--steps 3] [--group 4] [--prompts 4]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from _common import machine_facts, unique_photos

FIELDS = ("engine_up", "engine_down", "trainer_pixels", "seconds")


class Meter:
    """Per-step sums of what crossed the wire (HTTP bodies) and into the trainer."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.new_step()

    def new_step(self) -> None:
        self.steps.append(dict.fromkeys(FIELDS, 0.0))

    def add(self, key: str, value: float) -> None:
        self.steps[-1][key] += value


def callbacks(meter: Meter):
    from transformers import TrainerCallback

    class _Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            meter.add("seconds", time.monotonic() - self.t0)
            meter.new_step()

    return [_Timer()]


def dataset(photos: list[bytes]):
    """TRL's conversational rows, an ``image`` column of PIL images (the usual HF image dataset)."""
    import io

    from datasets import Dataset
    from PIL import Image

    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in photos]
    prompts = [[{"role": "user", "content": f"Describe picture {i}."}] for i in range(len(photos))]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def stock_rollout(url: str, processor, pusher, meter: Meter):
    """TRL's server-mode VLM rollout (see the module doc) as a ``rollout_func``."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    client = VLLMClient(base_url=url)

    def count(response, *args, **kwargs) -> None:  # a requests hook: must return None
        meter.add("engine_up", len(response.request.body or b""))
        meter.add("engine_down", len(response.content))

    client.session.hooks["response"].append(count)
    placer = SimpleNamespace(processing_class=processor)
    pushed = {"step": -1}

    def rollout(prompts, trainer):
        if trainer.state.global_step != pushed["step"]:
            pusher.push(trainer.model, f"stock-{trainer.state.global_step}")
            pushed["step"] = trainer.state.global_step
        g = trainer.num_generations
        unique = prompts[::g]
        ids = processor.apply_chat_template(
            unique, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = [list(x) for x in ids["input_ids"]]
        images = [[p["image"] for m in msgs for p in m["content"] if p["type"] == "image"] for msgs in unique]
        features = [
            VLLMGeneration._place_features(placer, f, i)
            for f, i in zip(client.image_features(images), ids, strict=True)
        ]
        params = {"n": g, "temperature": trainer.temperature, "max_tokens": trainer.max_completion_length}
        params.update(logprobs=0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, output_kind=2)
        # the image placeholder biased out, as mmref does: a completion that samples it breaks TRL's
        # own forward ("Image features and image tokens do not match")
        params["logit_bias"] = {str(processor.image_token_id): -100}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt_ids, feats in zip(ids, features, strict=True):
            body = {
                "request_id": "trl-stock",
                "model": client.model,
                "token_ids": prompt_ids,
                "features": feats,
            }
            answer = client.session.post(
                f"{url}/inference/v1/generate", json={**body, "sampling_params": params}
            )
            answer.raise_for_status()
            for choice in answer.json()["choices"]:
                out["prompt_ids"].append(prompt_ids)
                out["completion_ids"].append(choice["token_ids"])
                out["logprobs"].append([c["logprob"] for c in choice["logprobs"]["content"]])
        return out

    return rollout


def stock_trainer_class():
    from trl import GRPOTrainer

    class StockGRPOTrainer(GRPOTrainer):
        """TRL's trainer, unchanged, measuring the ``pixel_values`` its processor built."""

        meter: Meter

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            pixels = output.get("pixel_values")
            if pixels is not None:
                self.meter.add("trainer_pixels", pixels.numel() * pixels.element_size())
            return output

    return StockGRPOTrainer


def run(kind: str, args, model_dir: Path, root: Path, url: str, photos: list[bytes]) -> Meter:
    import httpx
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from demo_trl import cpu_grpo_config
    from integrations.common import MMRefSettings, WeightPusher
    from integrations.trl import MMRefGRPOTrainer
    from rollout_client import RolloutClient

    meter = Meter()
    config = cpu_grpo_config(
        root / kind, steps=args.steps, prompts=args.prompts, group=args.group, completion_tokens=16
    )
    common = dict(
        model=AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=lambda completions, **k: [float(len(c[0]["content"])) for c in completions],
        args=config,
        train_dataset=dataset(photos),
        processing_class=AutoProcessor.from_pretrained(model_dir),
        callbacks=callbacks(meter),
    )
    if kind == "stock":
        pusher = WeightPusher(httpx.Client(base_url=url), root / "weights-stock", timeout_s=120)
        cls = stock_trainer_class()
        trainer = cls(**common, rollout_func=stock_rollout(url, common["processing_class"], pusher, meter))
        trainer.meter = meter
    else:

        def hook(response):
            meter.add("engine_up", len(response.request.content))
            meter.add("engine_down", len(response.read()))

        settings = MMRefSettings(server_url=url, model_dir=model_dir, output_root=root, seq_len=4096)
        http = httpx.Client(event_hooks={"response": [hook]})
        client = RolloutClient(url, model_dir, settings.rollout_asset_root(), http_client=http)
        trainer = MMRefGRPOTrainer(**common, mmref=settings, rollout_client=client)
    trainer.train()
    if kind == "mmref":
        for step, report in zip(meter.steps, trainer.mmref_reports, strict=False):
            step["trainer_pixels"] += report.trainer_pixel_bytes
            step["trainer_pixels"] += sum(
                len(i.ref) for r in report.rows if r.sample.mm_refs for i in r.sample.mm_refs.items
            )
    meter.steps = meter.steps[: args.steps]
    return meter


def table(stock: Meter, mmref: Meter) -> list[str]:
    rows = ["| per step (mean) | TRL stock VLM path | TRL + mmref | stock / mmref |", "|---|---|---|---|"]
    labels = {
        "engine_up": "bytes to the rollout engine",
        "engine_down": "bytes from the rollout engine",
        "trainer_pixels": "bytes of image input to the trainer",
        "seconds": "step time, s",
    }
    for key, label in labels.items():
        a = sum(s[key] for s in stock.steps) / len(stock.steps)
        b = sum(s[key] for s in mmref.steps) / len(mmref.steps)
        fmt = (lambda x: f"{x:.2f}") if key == "seconds" else (lambda x: f"{x:,.0f}")
        rows.append(
            f"| {label} | {fmt(a)} | {fmt(b)} | {a / b:.1f}x |"
            if b
            else f"| {label} | {fmt(a)} | {fmt(b)} | - |"
        )
    return rows


def main() -> None:
    from make_tiny_models import ensure_tiny_model
    from vllm_server import start_server

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="num_generations")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (one photo each) per step")
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--json", type=Path, help="also write the per-step figures here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mmref-bench-trl-"))
    model_dir = ensure_tiny_model(args.family)
    photos = unique_photos(args.prompts)
    server = start_server(
        model_dir,
        root,
        root / "server.log",
        extra_args=("--enable-scale-out", "--logprobs-mode", "processed_logprobs"),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        stock = run("stock", args, model_dir, root, server.url, photos)
        mmref = run("mmref", args, model_dir, root, server.url, photos)
    finally:
        server.stop()
    for k, v in machine_facts():
        print(f"{k:<28} {v}")
    print(
        f"rows per step: {args.prompts} prompts x {args.group} samples, one 1024x768 JPEG photo per "
        f"prompt, {args.steps} steps, tiny {args.family}"
    )
    print("\n".join(table(stock, mmref)))
    if args.json:
        args.json.write_text(json.dumps({"stock": stock.steps, "mmref": mmref.steps}, indent=1))


if __name__ == "__main__":
    main()
