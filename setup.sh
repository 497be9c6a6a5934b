#!/usr/bin/env bash
# Create .venv and install finetune into it, CPU torch first (a bare `torch` requirement
# would pull several GB of CUDA packages), at the versions the suite passed with
# (constraints.txt). Idempotent: re-runs only when this file, pyproject.toml,
# constraints.txt or finetune's version change.
#   bash setup.sh           .venv, the tested versions (what CI runs)
#   bash setup.sh --latest  .venv-latest, the newest versions pyproject.toml allows, to
#                           check upcoming releases (README, "Dependencies"); torch
#                           stays at the CPU build below (pyproject leaves torch out: the
#                           newest torch of an index may be a CUDA build of several GB)
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
venv=.venv
torch=torch==2.13.0
pins=(-c constraints.txt)
case "${1:-}" in
  "") ;;
  --latest) venv=.venv-latest; pins=(--upgrade --upgrade-strategy eager -c "$venv/torch.txt") ;;
  *) echo "usage: bash setup.sh [--latest]" >&2; exit 2 ;;
esac
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
echo "$torch" > "$venv/torch.txt"
stamp=$venv/.finetune-install
# finetune/__init__.py holds the version the install's metadata records.
want=$(cat setup.sh pyproject.toml constraints.txt finetune/__init__.py | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing into $venv ($torch, then finetune and its test tools)"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}")
  "${pip[@]}" "$torch"
  "${pip[@]}" -e ".[test]"
  echo "$want" > "$stamp"
fi
