"""What every tiny model shares: recipe constants, the byte-level tokenizer, the marker file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

MARKER_FILE = "tiny_model_recipe.json"

# Bump when the build code changes in a way the per-family specs do not capture.
RECIPE_VERSION = 1
SEED = 0
VOCAB_SIZE = 512

CLIP_MEAN: list[float] = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD: list[float] = [0.26862954, 0.26130258, 0.27577711]
HALF: list[float] = [0.5, 0.5, 0.5]


def build_tokenizer(
    special_tokens: tuple[str, ...],
    *,
    eos_token: str,
    pad_token: str,
    chat_template: str,
) -> PreTrainedTokenizerFast:
    """Build the byte-level BPE tokenizer (ids 0..255 are the bytes) with the given special tokens.

    The special tokens take ids 256.. in listed order.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Register the special tokens on the backend first so they take ids 256.. in listed order.
    backend.add_special_tokens([AddedToken(token, special=True) for token in special_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
        model_max_length=32768,
    )
    expected = {token: 256 + i for i, token in enumerate(special_tokens)}
    actual = {token: tokenizer.convert_tokens_to_ids(token) for token in special_tokens}
    if actual != expected:
        raise RuntimeError(f"special token ids {actual} differ from {expected}")
    return tokenizer


def write_marker(out_dir: Path, family: str, recipe_hash: str) -> None:
    """Write the marker that says ``out_dir`` holds a finished build of this recipe."""
    marker = {"family": family, "recipe_hash": recipe_hash, "version": RECIPE_VERSION}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
