#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite: real vLLM server, real processors, real photos.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh verl  # the verl extra: integrations.verl is tested against verl's classes
export HF_HUB_OFFLINE=1
.venv/bin/python scripts/make_tiny_models.py --family all
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
