"""trainer_lib.distributed: one rank's error fails every rank before any collective; every rank plans
the same balanced step on its own and runs the same collectives (2 gloo CPU processes)."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import join_ranks, photo_bytes
from protocol.adapters import offload_image
from protocol.errors import AssetNotFound, PlaceholderMismatch
from protocol.refs import format_mmraw, parse_ref
from protocol.structs import MMRefs, TrainingSample, encode
from trainer_lib.distributed import RankFailed, check_all_ranks, fail_fast
from trainer_lib.planning.packing import pack_samples
from trainer_lib.planning.plan import plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.spec import PackingSpec

TIMEOUT_S = 120


def sample(refs) -> TrainingSample:
    return TrainingSample(
        input_ids=list(range(8)),
        loss_mask=[True] * 8,
        advantages=[1.0] * 8,
        inference_logprobs=[-1.0] * 8,
        mm_refs=MMRefs(items=list(refs)),
    )


class Unpicklable(Exception):
    def __init__(self, message: str, handle) -> None:
        super().__init__(message)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("cannot pickle this error")


class Unprintable(Unpicklable):
    """Unpicklable, with a ``ref`` that is no string and a ``str()`` that raises: the stand-in
    built for it must not fail (the failing rank would leave the other in the second collective)."""

    def __init__(self, message: str, handle) -> None:
        super().__init__(message, handle)
        self.ref = handle

    def __str__(self) -> str:
        raise RuntimeError("no str")


def _step_samples(image, tok: int) -> list[TrainingSample]:
    """A step for two ranks: samples with the image, text of many lengths, two LoRAs, a stray
    placeholder in text (whoever plans it, every rank must get the same micro-batches)."""
    out = []
    for k in range(13):
        ids = [1, 2, *([tok] * image.num_placeholders), 3] if k % 3 == 0 else [5] * (7 + 11 * k)
        if k == 4:
            ids[3] = tok  # a literal placeholder in text
        ids += [6] * (3 + 5 * k)
        out.append(
            TrainingSample(
                input_ids=ids, loss_mask=[False] + [True] * (len(ids) - 1), advantages=[1.0] * len(ids),
                inference_logprobs=[-1.0] * len(ids), mm_refs=MMRefs(items=[image]) if k % 3 == 0 else None,
                lora_id="ab"[k % 2],
            )
        )  # fmt: skip
    return out


def _run_plan(rank: int, world: int, adapter, image, out_dir: Path) -> None:
    """Plan on this rank alone, compare the plans' bytes, then one collective per micro-batch (as
    FSDP gathers per micro-batch): unequal counts would hang here, unaligned vision slots show."""
    tok = 261
    spec = PackingSpec(placeholder_token_id=tok, pad_token_id=0, adapter=adapter)
    plan = plan_step(
        _step_samples(image, tok),
        spec,
        StepShape(dp_size=world, mini_batch_size=8, seq_len=512, micro_batch_max_tokens=256),
    )
    wire = [encode(mb.micro_batch) for mbs in plan.mini_batches for r in mbs for mb in r.micro_batches]
    digests: list = [None] * world
    dist.all_gather_object(digests, hashlib.sha256(b"".join(wire)).hexdigest())
    vision = []
    for ranks in plan.mini_batches:
        for mb in ranks[rank].micro_batches:
            flags = torch.tensor([int(mb.has_pixels), -int(mb.has_pixels)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # [any rank has pixels, -(every rank has)]
            vision.append([int(flags[0]), -int(flags[1])])
    seen = [s.sample_index for mbs in plan.mini_batches for mb in mbs[rank].micro_batches for s in mb.slots]
    info = {"digests": digests, "vision": vision, "samples": [i for i in seen if i is not None]}
    (out_dir / f"plan.rank{rank}.json").write_text(json.dumps(info))


def _record(out: Path, phase: str, rank: int, error: BaseException | None) -> None:
    info = None
    if error is not None:
        try:
            message = str(error)
        except Exception:
            message = None
        ref = getattr(error, "ref", None)
        info = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": message,
            "ref": ref if ref is None or isinstance(ref, str) else type(ref).__name__,
            "notes": getattr(error, "__notes__", []),
            "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None,
        }
    (out / f"{phase}.rank{rank}.json").write_text(json.dumps(info))


def _worker(
    rank: int, world: int, init_file: str, model_dir: str, root: str, good, missing, out: str
) -> None:
    from protocol.adapters import load_adapter
    from trainer_lib import MaterializeOptions, materialize

    out_dir = Path(out)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        adapter = load_adapter(model_dir)

        # 1. nobody fails: the check is one all-reduce, then the step's collectives run
        with fail_fast():
            batch = materialize([sample([good])], adapter, root, MaterializeOptions(policy="error"))
        total = torch.tensor([batch.stats.images], dtype=torch.int64)
        dist.all_reduce(total)
        _record(out_dir, "ok", rank, None)
        (out_dir / f"ok.rank{rank}.total").write_text(str(int(total)))

        # 1b. each rank plans the step on its own: the same plan, the same collectives
        _run_plan(rank, world, adapter, good, out_dir)

        # 2. rank 1's image is missing under policy "error": both ranks raise the same error
        refs = [good] if rank == 0 else [good, missing]
        try:
            with fail_fast():
                materialize([sample(refs)], adapter, root, MaterializeOptions(policy="error"))
            dist.all_reduce(torch.ones(1))  # the step's first collective: never reached
            _record(out_dir, "missing", rank, None)
        except Exception as e:
            _record(out_dir, "missing", rank, e)

        # 2b. a packing error on rank 1 (its ids lack the image's placeholder tokens): same
        tok = 261  # <|image_pad|> of the tiny models
        ids = [1, 2, *([tok] * good.num_placeholders), 3] if rank == 0 else [1, 2, 3]
        bad = msgspec.structs.replace(
            sample([good]), input_ids=ids, loss_mask=[False] * len(ids), advantages=[0.0] * len(ids),
            inference_logprobs=[0.0] * len(ids),
        )  # fmt: skip
        try:
            with fail_fast():
                pack_samples([bad], PackingSpec(placeholder_token_id=tok, pad_token_id=0), seq_len=4096)
            dist.all_reduce(torch.ones(1))
            _record(out_dir, "packing", rank, None)
        except Exception as e:
            _record(out_dir, "packing", rank, e)

        # 3. both ranks fail differently: everyone raises the lowest rank's error
        try:
            check_all_ranks(ValueError(f"bad batch on rank {rank}"))
        except Exception as e:
            _record(out_dir, "both", rank, e)

        # 4. an error that cannot be pickled arrives as RankFailed with its type, message and ref
        try:
            check_all_ranks(Unpicklable("socket gone", handle=object()) if rank == 1 else None)
        except Exception as e:
            _record(out_dir, "unpicklable", rank, e)

        # 5. one whose str() raises and whose ref is no string: RankFailed all the same, no hang
        try:
            check_all_ranks(Unprintable("x", handle=object()) if rank == 1 else None)
        except Exception as e:
            _record(out_dir, "unprintable", rank, e)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def refs(qwen2_vl_adapter, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist") / "run_5" / "assets"
    good = offload_image(photo_bytes("coffee"), root, qwen2_vl_adapter)
    gone_uri = (root / "images" / "eeeeeeeeeeeeeeee.jpg").as_uri()
    body = msgspec.structs.replace(parse_ref(good.ref), raw_image_uri=gone_uri, mm_hash="e" * 32)
    missing = msgspec.structs.replace(good, ref=format_mmraw(body))
    return root, good, missing


def test_one_rank_error_fails_both_ranks_without_hanging(refs, qwen2_vl_dir, tmp_path):
    root, good, missing = refs
    out = tmp_path / "out"
    out.mkdir()
    args = (2, str(tmp_path / "pg_init"), str(qwen2_vl_dir), str(root), good, missing, str(out))
    ctx = mp.start_processes(_worker, args=args, nprocs=2, join=False, start_method="spawn")
    join_ranks(ctx, TIMEOUT_S)

    def read(phase: str) -> list:
        return [json.loads((out / f"{phase}.rank{r}.json").read_text()) for r in (0, 1)]

    assert read("ok") == [None, None]
    assert [(out / f"ok.rank{r}.total").read_text() for r in (0, 1)] == ["2", "2"]

    p0, p1 = read("plan")
    assert p0["digests"][0] == p0["digests"][1] and p0["digests"] == p1["digests"]  # the same plan
    assert p0["vision"] == p1["vision"] and all(a == b for a, b in p0["vision"])  # aligned, same count
    assert [1, 1] in p0["vision"]  # some micro-batch runs the vision tower on both ranks
    assert sorted(p0["samples"] + p1["samples"]) == list(range(16))  # 13 samples + 3 count pads, once

    r0, r1 = read("missing")
    assert r0 is not None and r1 is not None, "both ranks must raise"
    name = f"{AssetNotFound.__module__}.{AssetNotFound.__qualname__}"
    assert r0["type"] == r1["type"] == name
    assert r0["message"] == r1["message"] and r0["ref"] == r1["ref"] == missing.ref
    assert r1["notes"] == [] and r0["notes"] == [
        "raised on rank 1; re-raised on rank 0 by trainer_lib.distributed"
    ]

    r0, r1 = read("packing")
    name = f"{PlaceholderMismatch.__module__}.{PlaceholderMismatch.__qualname__}"
    assert r0 is not None and r0["type"] == r1["type"] == name and r0["message"] == r1["message"]
    assert "0 image placeholder tokens" in r0["message"] and r0["ref"] == good.ref

    r0, r1 = read("both")
    assert r0["message"] == r1["message"] == "bad batch on rank 0"
    assert r1["cause"] == "ValueError" and r0["cause"] is None  # rank 1's own error is kept as the cause

    r0, r1 = read("unpicklable")
    rank_failed = f"{RankFailed.__module__}.{RankFailed.__qualname__}"
    assert (
        r0["type"] == rank_failed and "test_distributed.Unpicklable on rank 1: socket gone" in r0["message"]
    )
    assert r1["type"].endswith("Unpicklable")

    r0, r1 = read("unprintable")
    assert r0["type"] == rank_failed and r0["ref"] is None
    assert "Unprintable on rank 1: <an error whose str() raised>" in r0["message"]
    assert r1["type"].endswith("Unprintable") and r1["message"] is None and r1["ref"] == "object"


def test_without_a_process_group_errors_pass_through():
    assert not dist.is_initialized()
    check_all_ranks(None)
    with pytest.raises(KeyError):
        with fail_fast():
            raise KeyError("x")
