"""The packed forward under FSDP2 (``trainer_lib.shard_model``): 2 gloo CPU ranks, spawned processes.

Each rank plans the step on its own (``plan_step`` on ``StepShape(dp_size=2, ...)``: the balanced
plan), runs its micro-batches through the sharded model (tiny Qwen2-VL and Qwen3.5, activation
checkpointing on, training mode, real photos through ``materialize_micro_batch``), with the loss
normalised by the mini-batch's loss tokens over both ranks; the summed loss and every parameter's gradient
(gathered from the shards) must equal one unsharded process running the same samples planned
for one rank. Then fail-fast: rank 1's
image is missing under ``missing_policy="error"``; both ranks raise the same error before any
FSDP collective, and both then run another sharded step (nothing hangs, nothing is left half done).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import PAD, Family, chat, join_ranks
from protocol.errors import AssetNotFound
from protocol.refs import format_mmraw, parse_ref
from trainer_lib import StepShape, plan_step

TIMEOUT_S = 240
GRAD_RTOL = 1e-5


def _setup(model_dir: str, root: str):
    from transformers import AutoModelForImageTextToText

    from protocol.adapters import load_adapter
    from trainer_lib import MaterializeConfig, PackingSpec, prepare_model_for_packing

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    prepare_model_for_packing(model)  # activation checkpointing on (the default)
    model.train()
    adapter = load_adapter(model_dir)
    spec = PackingSpec.from_adapter(adapter, model, pad_token_id=PAD)
    return model, spec, MaterializeConfig(asset_root=root, missing_policy="error")


def _loss(model, spec, config, samples, dp_size: int, rank: int) -> torch.Tensor:
    """This rank's share of the step's loss, backward run: the sampled tokens' logprobs and a
    little entropy, normalised by the loss tokens of every rank (``plan_step`` on this rank)."""
    from trainer_lib import StepShape, materialize_micro_batch, packed_inputs, packed_logprobs, plan_step

    shape = StepShape(dp_size=dp_size, mini_batch_size=len(samples), seq_len=1024, micro_batch_max_tokens=400)
    plan = plan_step(samples, spec, shape)
    (ranks,) = plan.mini_batches
    norm = plan.num_loss_tokens_per_mini_batch[0]
    total = torch.zeros(())
    resolved: dict = {}
    for mb in ranks[rank].micro_batches:
        m = materialize_micro_batch(mb, spec, config, resolved=resolved)
        inputs = packed_inputs(m.packed, m.features, model, spec, image_index=m.image_index)
        out = packed_logprobs(model, inputs, temperature=0.8)
        assert out.activation_checkpointing
        mask = out.loss_mask
        loss = ((out.logprobs * mask).sum() - 0.1 * (out.entropy * mask).sum()) / norm
        loss.backward()
        total += loss.detach()
    return total


def _worker(rank: int, world: int, init_file: str, model_dir: str, root: str, samples, bad, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from trainer_lib import fail_fast, materialize_micro_batch, pack_samples, shard_model

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    out_dir = Path(out)
    try:
        model, spec, config = _setup(model_dir, root)
        shard_model(model, mesh=init_device_mesh("cpu", (world,)))
        loss = _loss(model, spec, config, samples, world, rank)
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, out_dir / "sharded.pt")

        # fail-fast under FSDP2: rank 1's image is gone; both raise before any FSDP collective
        mine = [bad] if rank == 1 else samples[:1]
        error = None
        try:
            with fail_fast():
                (mb,) = pack_samples(mine, spec, seq_len=1024).micro_batches
                materialize_micro_batch(mb, spec, config)
        except Exception as e:
            error = {"type": type(e).__name__, "message": str(e), "ref": getattr(e, "ref", None)}
        model.zero_grad(set_to_none=True)
        after = _loss(model, spec, config, samples, world, rank)  # the next step runs
        dist.all_reduce(after)
        info = {"error": error, "after": float(after)}
        (out_dir / f"fail.rank{rank}.json").write_text(json.dumps(info))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_fsdp2_two_ranks_equal_one_process_and_fail_fast_holds(family, tmp_path):
    """Qwen2-VL, and Qwen3.5 (its per-segment linear attention inside sharded, checkpointed layers)."""
    fam = Family(family, tmp_path / "run_8" / "assets")
    samples = fam.samples()
    good = fam.refs["coffee"]
    gone = (fam.root / "images" / "dddddddddddddddd.jpg").as_uri()
    body = msgspec.structs.replace(parse_ref(good.ref), raw_image_uri=gone, mm_hash="d" * 32)
    bad = chat([msgspec.structs.replace(good, ref=format_mmraw(body))], "lost", "ok", fam.tok)

    out = tmp_path / "out"
    out.mkdir()
    args = (2, str(tmp_path / "pg"), str(fam.dir), str(fam.root), samples, bad, str(out))
    ctx = mp.start_processes(_worker, args=args, nprocs=2, join=False, start_method="spawn")
    # meanwhile, the reference: one unsharded process, the same samples planned for one rank
    model, spec, config = _setup(str(fam.dir), str(fam.root))
    plan = plan_step(
        samples,
        spec,
        StepShape(dp_size=2, mini_batch_size=len(samples), seq_len=1024, micro_batch_max_tokens=400),
    )
    assert all(
        any(mb.has_pixels for mb in r.micro_batches) for r in plan.mini_batches[0]
    )  # both ranks' towers
    want_loss = _loss(model, spec, config, samples, 1, 0)
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    join_ranks(ctx, TIMEOUT_S)

    got = torch.load(out / "sharded.pt")
    assert got["grads"].keys() == want.keys() and len(want) > 20
    num = sum(((got["grads"][k] - want[k]) ** 2).sum() for k in want)
    rel = float(torch.sqrt(num / sum((w**2).sum() for w in want.values())))
    loss, want_loss = float(got["loss"]), float(want_loss)
    print(f"\nFSDP2 2 ranks vs 1 process: loss {loss:.6f} / {want_loss:.6f}, gradients relative {rel:.2e}")
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert rel <= GRAD_RTOL

    r0, r1 = (json.loads((out / f"fail.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["error"] is not None and r0["error"] == r1["error"], (r0, r1)
    assert r0["error"]["type"] == AssetNotFound.__name__ and r0["error"]["ref"] == bad.mm_refs.items[0].ref
    assert r0["after"] == pytest.approx(want_loss, rel=1e-5) and r0["after"] == r1["after"]
