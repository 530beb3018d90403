#!/usr/bin/env bash
# Install (idempotent) and run the end-to-end demo (scripts/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
HF_HUB_OFFLINE=1 .venv/bin/python scripts/demo.py "$@"
