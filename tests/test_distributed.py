"""trainer_lib.distributed: one rank's error fails every rank before any collective (2 gloo CPU processes)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import photo_bytes
from protocol.adapters import offload_image
from protocol.errors import AssetNotFound, PlaceholderMismatch
from protocol.refs import format_mmraw, parse_ref
from protocol.structs import MMRefs, TrainingSample
from trainer_lib.distributed import RankFailed, check_all_ranks, fail_fast
from trainer_lib.packing import pack_samples

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


def _record(out: Path, phase: str, rank: int, error: BaseException | None) -> None:
    info = None
    if error is not None:
        info = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": str(error),
            "ref": getattr(error, "ref", None),
            "notes": getattr(error, "__notes__", []),
            "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None,
        }
    (out / f"{phase}.rank{rank}.json").write_text(json.dumps(info))


def _worker(
    rank: int, world: int, init_file: str, model_dir: str, root: str, good, missing, out: str
) -> None:
    from protocol.adapters import load_adapter
    from trainer_lib import materialize

    out_dir = Path(out)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        adapter = load_adapter(model_dir)

        # 1. nobody fails: the check is one all-reduce, then the step's collectives run
        with fail_fast():
            batch = materialize([sample([good])], adapter, root, policy="error")
        total = torch.tensor([batch.stats.images], dtype=torch.int64)
        dist.all_reduce(total)
        _record(out_dir, "ok", rank, None)
        (out_dir / f"ok.rank{rank}.total").write_text(str(int(total)))

        # 2. rank 1's image is missing under policy "error": both ranks raise the same error
        refs = [good] if rank == 0 else [good, missing]
        try:
            with fail_fast():
                materialize([sample(refs)], adapter, root, policy="error")
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
                pack_samples([bad], placeholder_token_id=tok, seq_len=4096)
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
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {TIMEOUT_S} s: a rank hangs in a collective")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()

    def read(phase: str) -> list:
        return [json.loads((out / f"{phase}.rank{r}.json").read_text()) for r in (0, 1)]

    assert read("ok") == [None, None]
    assert [(out / f"ok.rank{r}.total").read_text() for r in (0, 1)] == ["2", "2"]

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


def test_without_a_process_group_errors_pass_through():
    assert not dist.is_initialized()
    check_all_ranks(None)
    with pytest.raises(KeyError):
        with fail_fast():
            raise KeyError("x")
