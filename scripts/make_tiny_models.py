"""Build tiny random-weight Qwen and Kimi vision-language models offline (the :mod:`tiny_models` package).

Families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE (complete model
directories with weights, tokenizer and the real transformers processors), Kimi K2.5 and Kimi-VL
(config, tokenizer and processor config; vLLM serves them with dummy weights, docs/KIMI.md).
``kimi_vl`` is built only on request: its HF processor is remote code.

Usage::

    python scripts/make_tiny_models.py [--out DIR] [--family FAMILY|all]

or, from Python (with ``scripts/`` on ``sys.path``), ``ensure_tiny_model("qwen2_vl")``. Builds
are cached: a directory whose marker file holds the current recipe hash is reused as is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tiny_models import FAMILIES, REMOTE_CODE_FAMILIES, build_into, ensure_tiny_model

__all__ = ["ensure_tiny_model", "main"]  # ensure_tiny_model: what scripts, benches and tests import


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: build the requested families and print their paths."""
    parser = argparse.ArgumentParser(description="Build tiny random-weight Qwen and Kimi VL models offline.")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: <repo>/.cache/tiny_models/<family>); "
        "with --family all, the parent of one folder per family",
    )
    parser.add_argument(
        "--family",
        choices=[*FAMILIES, *REMOTE_CODE_FAMILIES, "all"],
        default="all",
        help=f"'all' builds {', '.join(FAMILIES)}; {', '.join(REMOTE_CODE_FAMILIES)} needs remote code",
    )
    args = parser.parse_args(argv)

    if args.family == "all":
        paths = [ensure_tiny_model(family, args.out) for family in FAMILIES]
    elif args.out is not None:
        paths = [build_into(args.family, args.out)]
    else:
        paths = [ensure_tiny_model(args.family)]
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
