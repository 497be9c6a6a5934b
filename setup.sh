#!/usr/bin/env bash
# Create .venv and install finetune into it, CPU torch first (a bare `torch` requirement
# would pull several GB of CUDA packages). Idempotent: re-runs only when pyproject changes.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.finetune-install
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing into .venv (torch==2.13.0, then finetune and its test tools)"
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want" > "$stamp"
fi
