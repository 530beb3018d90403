"""The RL loop inside TRL: ``GRPOTrainer`` on a live mmref server (``bash scripts/demo.sh --framework trl``).

1. builds the tiny model of ``--family`` and a TRL dataset of chat prompts whose ``image`` column
   holds photo files (scikit-image), one row naming a file that does not exist;
2. starts vLLM with the mmref plugin (``VLLM_SERVER_DEV_MODE=1``, ``processed_logprobs``);
3. trains ``--steps`` GRPO steps with :class:`integrations.trl.MMRefGRPOTrainer`: rollouts by ref
   (``--group`` samples per prompt, one ``X-Session-ID`` each), TRL's reward and advantage code,
   the batch rebuilt from the refs by ``trainer_lib`` (packed forward, server logprobs as the
   behaviour policy), TRL's loss and optimizer step, the weights pushed before each generation;
4. per step prints the rewards, the pushed version, the server-vs-trainer mismatch on the step's
   completions (the trainer holds the served weights: float32 noise) beside the control (the same
   completions under the previous step's weights), and the unreadable row's stand-ins; fails if the
   mismatch is over its bound, the control within it, or a rollout came back under other weights.

Usage: ``.venv/bin/python scripts/demo.py --framework trl [--family F] [--steps N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from demo_rl import jpeg, mismatch_bound
from make_tiny_models import ensure_tiny_model
from tiny_models import SERVE_DTYPES
from vllm_server import start_server

if TYPE_CHECKING:
    from trl import GRPOConfig

PROMPTS = [
    (("astronaut", "coffee"), "Compare the two pictures."),
    (("chelsea",), "What do you see?"),
    (("missing",), "Describe this photo."),  # its file does not exist: a zero-loss stand-in row
]


def letters(completions, **kwargs) -> list[float]:
    """A toy reward: the share of letters in the completion's text."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def cpu_grpo_config(
    output_dir: Path, *, steps: int, prompts: int, group: int, completion_tokens: int, **extra: Any
) -> GRPOConfig:
    """TRL's ``GRPOConfig`` of a tiny run on the CPU, one place for the demo, ``bench/trl_grpo.py``
    and ``tests/test_integration_trl.py``: ``prompts`` x ``group`` rows per step, at most
    ``completion_tokens`` per completion, no KL term (``beta=0``), seed 0, no reports, no
    checkpoints, no gradient checkpointing; ``extra`` is passed on (``logging_steps``, ``bf16``, a
    setting a test expects refused...)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        max_completion_length=completion_tokens,
        learning_rate=1e-3,
        beta=0.0,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        gradient_checkpointing=False,
        seed=0,
        **extra,
    )


def dataset(folder: Path):
    """TRL's conversational format: ``prompt`` messages and an ``images`` column of file paths."""
    from datasets import Dataset

    folder.mkdir(parents=True, exist_ok=True)
    rows = {"prompt": [], "images": []}
    for names, text in PROMPTS:
        paths = []
        for name in names:
            path = folder / f"{name}.jpg"
            if name != "missing":
                path.write_bytes(jpeg(name))
            paths.append(str(path))
        rows["prompt"].append([{"role": "user", "content": text}])
        rows["images"].append(paths)
    return Dataset.from_dict(rows)


class Snapshots:
    """A TRL callback keeping the weights at the start of each step (the control's weights)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def hooks(self):
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kwargs):
                outer.states[state.global_step] = copy.deepcopy(model.state_dict())

        return _Callback()


def control_mismatch(trainer, report, state, spec, config) -> float:
    """Mean |d| of the server's logprobs of ``report``'s rows vs the trainer's under ``state``."""
    from trainer_lib import LogprobOptions, logprob_mismatch, recompute_logprobs

    previous = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
    previous.load_state_dict(state)
    samples = [r.sample for r in report.rows if not r.unreadable]
    per_sample = recompute_logprobs(
        samples,
        previous,
        spec,
        config,
        LogprobOptions(
            seq_len=2048,
            temperature=trainer.temperature,
            suppressed_token_ids=trainer.mmref_client.suppressed_token_ids(),
        ),
    )
    lp, mask = (torch.cat(t) for t in zip(*per_sample, strict=True))
    server = torch.cat([torch.tensor(s.inference_logprobs) for s in samples])
    return logprob_mismatch(lp, server, mask).mean_abs


def train(args, model_dir: Path, root: Path, url: str):
    """Build the trainer and run ``args.steps`` steps; returns the trainer and the snapshots."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from integrations.common import MMRefSettings
    from integrations.trl import MMRefGRPOTrainer

    config = cpu_grpo_config(
        root / "trl",
        steps=args.steps,
        prompts=len(PROMPTS),
        group=args.group,
        completion_tokens=12,
        logging_steps=1,
        bf16=False,
    )
    settings = MMRefSettings(server_url=url, model_dir=model_dir, output_root=root, seq_len=2048)
    snapshots = Snapshots()
    trainer = MMRefGRPOTrainer(
        AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=letters,
        args=config,
        train_dataset=dataset(root / "dataset"),
        processing_class=AutoProcessor.from_pretrained(model_dir),
        callbacks=[snapshots.hooks()],
        mmref=settings,
    )
    trainer.train()
    return trainer, snapshots


def report(args, trainer, snapshots, serve_dtype: str) -> list[str]:
    """One line per step; raises SystemExit on a failed check."""
    spec, config = trainer.mmref_spec, trainer.mmref.materialize_config()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lines, failures = [], []
    for k, gen in enumerate(trainer.mmref_reports):
        real = [r.sample for r in gen.rows if not r.unreadable]
        suppressed = trainer.mmref_client.suppressed_token_ids()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        bound = (
            1e-4
            if serve_dtype == "float32"
            else mismatch_bound(policy, real, spec, config, serve_dtype, suppressed)[0]
        )
        control = (
            control_mismatch(trainer, gen, snapshots.states[gen.step - 1], spec, config) if gen.step else None
        )
        m, push = gen.mismatch, gen.push
        lines.append(
            f"step {k + 1}: weights {gen.version!r} (pushed in {push.push_seconds:.2f} s, saved in "
            f"{push.save_seconds:.2f} s); {len(gen.rows)} rows by ref, {gen.unreadable_rows} "
            f"unreadable-image stand-ins (zero loss); reward {rewards[k]:.3f}; server vs trainer "
            f"mean |d| {m.mean_abs:.1e} "
            f"(max {m.max_abs:.1e}, bound {bound:.1e}); previous weights "
            + (f"{control:.1e}" if control is not None else "- (no earlier weights)")
        )
        if m.mean_abs > bound:
            failures.append(f"step {k + 1}: mismatch {m.mean_abs:.1e} over {bound:.1e}")
        if control is not None and control <= bound:
            failures.append(f"step {k + 1}: the control {control:.1e} is within the bound")
        if push is None or push.version != gen.version or gen.served_versions != {gen.version}:
            failures.append(f"step {k + 1}: weights not pushed before the rollouts")
        if gen.unreadable_rows != args.group:
            failures.append(f"step {k + 1}: {gen.unreadable_rows} stand-ins, expected {args.group}")
    if len(trainer.mmref_reports) != args.steps:
        failures.append(f"{len(trainer.mmref_reports)} generations for {args.steps} steps")
    if failures:
        raise SystemExit("; ".join(failures))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["trl"], default="trl")
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (num_generations)")
    parser.add_argument("--keep", type=Path, help="output root to use (kept); default a temp dir")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    root = args.keep or Path(tempfile.mkdtemp(prefix="mmref-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_tiny_model(args.family)
    serve_dtype = SERVE_DTYPES.get(args.family, "float32")
    print(
        f"[demo trl] tiny {args.family}; starting vLLM ({serve_dtype}) with VLLM_PLUGINS=mmref ... (~45-90 s)"
    )
    server = start_server(
        model_dir,
        root,
        root / "server.log",
        extra_args=(
            "--dtype",
            serve_dtype,
            "--enable-prefix-caching",
            "--logprobs-mode",
            "processed_logprobs",
        ),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        trainer, snapshots = train(args, model_dir, root, server.url)
    finally:
        server.stop()
    print("\n=== mmref + TRL GRPOTrainer report ===")
    import trl

    print(
        f"TRL {trl.__version__}, {args.family} served in {serve_dtype}, "
        f"trainer float32 ({trainer.mmref_backend})"
    )
    for line in report(args, trainer, snapshots, serve_dtype):
        print(line)
    print(f"total time {time.monotonic() - t0:.0f} s; output root {root}")


if __name__ == "__main__":
    main()
