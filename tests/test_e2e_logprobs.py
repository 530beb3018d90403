"""End to end on real parts: rollouts sampled by the real vLLM server from mmraw refs, then the
trainer's materialize + pack + packed forward reproduce the server's logprobs; a swapped image is
caught by the same check."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from helpers import photo_bytes, rollout
from protocol.adapters import offload_image
from protocol.structs import MMRefs
from trainer_lib import LogprobOptions, MaterializeConfig, PackingSpec, prepare_model_for_packing
from trainer_lib.mismatch import logprob_mismatch, recompute_logprobs

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


def test_trainer_reproduces_server_logprobs_and_flags_a_swapped_image(
    server, qwen2_vl_dir, qwen2_vl_adapter, photo_refs, asset_root, output_root
):
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    # two photos of one size (same grid), so one can stand in for the other in the negative control
    same_size = {
        n: offload_image(photo_bytes(n, size=(448, 336)), asset_root, qwen2_vl_adapter)
        for n in ("coffee", "rocket")
    }
    plans = [
        ([photo_refs["astronaut"], photo_refs["chelsea"]], "Compare the two pictures."),
        ([same_size["coffee"]], "What is in the cup?"),
        ([same_size["coffee"]], "Describe it."),
        ([], "Say something about cats."),
        ([same_size["rocket"]], "What is this?"),
    ]
    with server.client() as c:
        samples = [rollout(c, tokenizer, refs, text) for refs, text in plans]

    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32)
    model.eval()
    assert prepare_model_for_packing(model) == "sdpa"
    spec = PackingSpec.from_adapter(qwen2_vl_adapter, model, pad_token_id=0)  # no pad is made here
    config = MaterializeConfig(asset_root=output_root)
    results = recompute_logprobs(samples, model, spec, config, LogprobOptions(seq_len=2048))
    trainer = torch.cat([lp for lp, _ in results])
    mask = torch.cat([m for _, m in results])
    inference = torch.cat([torch.tensor(s.inference_logprobs) for s in samples])
    stats = logprob_mismatch(trainer, inference, mask)
    print(f"trainer vs server: {stats}")
    assert stats.tokens == sum(sum(s.loss_mask) for s in samples)
    assert stats.mean_abs <= 1e-4 and stats.max_abs <= 1e-3 and stats.k3_kl <= 1e-7

    # negative control: sample 1's coffee replaced by the rocket photo (same grid, same tokens)
    swapped = list(samples)
    swapped[1] = msgspec.structs.replace(samples[1], mm_refs=MMRefs(items=[same_size["rocket"]]))
    lp, m = recompute_logprobs(swapped, model, spec, config, LogprobOptions(seq_len=2048))[1]
    bad = logprob_mismatch(lp, torch.tensor(samples[1].inference_logprobs), m)
    print(f"swapped image: {bad}")
    assert bad.mean_abs > 100 * max(stats.mean_abs, 1e-7)

    # temperature 0.7: the server (--logprobs-mode processed_logprobs) returns the tempered
    # distribution's logprobs; the trainer reproduces them only when given the same temperature
    with server.client() as c:
        hot = [rollout(c, tokenizer, refs, text, temperature=0.7) for refs, text in plans[:3]]
    inference = torch.cat([torch.tensor(s.inference_logprobs) for s in hot])
    for temperature, check in (
        (0.7, lambda s: s.mean_abs <= 1e-4 and s.k3_kl <= 1e-7),
        (1.0, lambda s: s.mean_abs > 1e-2),
    ):
        options = LogprobOptions(seq_len=2048, temperature=temperature)
        results = recompute_logprobs(hot, model, spec, config, options)
        stats_t = logprob_mismatch(
            torch.cat([lp for lp, _ in results]), inference, torch.cat([m for _, m in results])
        )
        print(f"T=0.7 rollouts, trainer temperature {temperature}: {stats_t}")
        assert check(stats_t), stats_t
