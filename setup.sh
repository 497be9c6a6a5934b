#!/usr/bin/env bash
# Create .venv and install finetune into it, torch first, at the versions the suite passed
# with (constraints.txt). Idempotent: re-runs only when this file, pyproject.toml,
# constraints.txt, finetune's version or the torch build asked for change; a different
# torch build (CPU/CUDA, another index) reinstalls torch. docs/install.md.
#   bash setup.sh           .venv, the tested versions (what CI runs): torch==2.13.0 as pip
#                           resolves it, the CPU build where pip is offered one (this
#                           project's machines have a local torch-2.13.0+cpu wheel)
#   bash setup.sh --cuda    .venv with a CUDA build of torch 2.13.0 (PyPI's default on Linux
#                           x86_64 and aarch64), its torchvision and the gpu and vlm
#                           extras (liger-kernel, bitsandbytes; num2words); stops unless
#                           torch.version.cuda is set
#   --torch-index URL       take torch and its torchvision from this index, e.g. PyTorch's
#                           https://download.pytorch.org/whl/cu126 for an older driver
#                           (and the vlm extra)
#   bash setup.sh --latest  .venv-latest, the newest versions pyproject.toml allows, to
#                           check upcoming releases (docs/testing.md, "Dependencies"); torch
#                           stays at 2.13.0 (the newest torch of an index may be a
#                           CUDA build of several GB)
set -euo pipefail
cd "$(dirname "$0")"
usage() {
  echo "usage: bash setup.sh [--cuda] [--torch-index URL] [--latest]
  (none)             .venv: torch 2.13.0 as pip resolves it (CI: the CPU build) and finetune
  --cuda             .venv with a CUDA build of torch 2.13.0 (checked), its torchvision
                     and the gpu and vlm extras
  --torch-index URL  take torch and torchvision from this index, e.g.
                     https://download.pytorch.org/whl/cu126
  --latest           .venv-latest: the newest versions pyproject.toml allows"
}
python=${PYTHON:-python3}
venv=.venv
torch=torch==2.13.0
# torchvision's release for that torch (Qwen2-VL's processor and every other that takes
# videos need it: docs/vision.md). It comes with torch where torch's source holds its
# matching build: PyPI's CUDA wheels (--cuda) or an index given. The plain route leaves it
# out: pip may be offered a local torch wheel (this project's machines have a CPU one)
# beside which PyPI's torchvision, built for PyPI's torch, does not import.
torchvision=torchvision==0.28.0
cuda=0
index=
latest=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --latest) latest=1 ;;
    --torch-index=?*) index=${1#--torch-index=} ;;
    --torch-index)
      if [ $# -lt 2 ] || [ -z "$2" ] || [ "${2#-}" != "$2" ]; then
        echo "setup: --torch-index needs a URL" >&2; usage >&2; exit 2
      fi
      index=$2; shift ;;
    -h|--help) usage; exit 2 ;;
    *) echo "setup: unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
upgrade=()
pins=(-c constraints.txt)
if [ "$latest" = 1 ]; then
  venv=.venv-latest
  upgrade=(--upgrade --upgrade-strategy eager)
  pins=(-c "$venv/torch.txt")
fi
if [ "$cuda" = 1 ]; then
  os=$(uname -s) arch=$(uname -m)
  if [ "$os" != Linux ] || { [ "$arch" != x86_64 ] && [ "$arch" != aarch64 ]; }; then
    echo "setup: --cuda needs Linux on x86_64 or aarch64, the platforms with CUDA builds of" \
      "torch that this script installs; this machine is $os $arch. Use: bash setup.sh" >&2
    exit 1
  fi
fi
# What decides the torch build: a change reinstalls torch (pip would keep an installed
# 2.13.0 of the other build, which satisfies torch==2.13.0 too).
key=$torch
[ "$cuda" = 1 ] && key="$key cuda"
[ -n "$index" ] && key="$key from $index"
extras=test
[ "$cuda" = 1 ] && extras=$extras,gpu
# the routes that bring torchvision bring the rest vision-language processors need
{ [ "$cuda" = 1 ] || [ -n "$index" ]; } && extras=$extras,vlm
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
printf '%s\n' "$torch" "$torchvision" > "$venv/torch.txt"
stamp=$venv/.finetune-install
built=$venv/.finetune-torch  # the key of the torch installed (absent: the CPU route's)
# finetune/__init__.py holds the version the install's metadata records.
want=$({ echo "$key"; cat setup.sh pyproject.toml constraints.txt finetune/__init__.py; } |
  sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing into $venv ($key, then finetune with extras $extras)"
  py=$venv/bin/python
  pip=("$py" -m pip install -q --disable-pip-version-check)
  [ "$latest" = 1 ] && pip+=("${upgrade[@]}")  # bash 3.2 (macOS) with set -u: no empty arrays
  if [ "$(cat "$built" 2>/dev/null || echo "$torch")" != "$key" ] &&
      "$py" -m pip show -q torch >/dev/null 2>&1; then
    echo "setup: replacing the installed torch ($(cat "$built" 2>/dev/null || echo "$torch"))"
    drop=(torch)  # and the torchvision built for it
    "$py" -m pip show -q torchvision >/dev/null 2>&1 && drop+=(torchvision)
    "$py" -m pip uninstall -q -y "${drop[@]}"
  fi
  echo "$key (incomplete)" > "$built"
  torch_args=("${pins[@]}")
  # An index such as PyTorch's holds its own copies of torch's dependencies, not every
  # version constraints.txt pins: they come from there, and the next step pins them.
  [ -n "$index" ] && torch_args=(--index-url "$index")
  report=$venv/.finetune-torch-report.json  # where pip took torch from, for the check
  rm -f "$report"
  if [ "$cuda" = 1 ] && "$py" -m pip install --help 2>/dev/null | grep -q -- --report; then
    torch_args+=(--report "$report")
  fi
  torch_step=("$torch")
  if [ "$cuda" = 1 ] || [ -n "$index" ]; then torch_step+=("$torchvision"); fi
  "${pip[@]}" "${torch_args[@]}" "${torch_step[@]}"
  if [ "$cuda" = 1 ]; then
    read -r version cuda_version < <("$py" -W ignore -c \
      'import torch; print(torch.__version__, torch.version.cuda)') || {
      echo "setup: --cuda: the installed torch does not import (above)." >&2; exit 1; }
    if [ "$cuda_version" = None ]; then
      source=$("$py" -c 'import json, sys
r = json.load(open(sys.argv[1]))
print(" ".join(i["download_info"]["url"] for i in r["install"]
               if i["metadata"]["name"] == "torch") or "(it was installed already)")' \
        "$report" 2>/dev/null || echo "(unknown)")
      again="bash setup.sh --cuda"
      [ "$latest" = 1 ] && again="$again --latest"
      pytorch_index="$again --torch-index https://download.pytorch.org/whl/cu126"
      [ -n "$index" ] && again="$again --torch-index $(printf '%q' "$index")"
      prefix=PIP_CONFIG_FILE=/dev/null
      for name in PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_NO_INDEX; do
        [ -n "${!name+set}" ] && prefix="-u $name $prefix"
      done
      [ "$prefix" = PIP_CONFIG_FILE=/dev/null ] || prefix="env $prefix"
      {
        echo "setup: --cuda installed torch $version, a build without CUDA" \
          "(torch.version.cuda is None), and stopped: finetune is not installed."
        echo "  pip took it from: $source"
        if [ -n "$index" ]; then
          echo "  The index $index serves no CUDA build of $torch, or pip preferred a CPU"
          echo "  wheel that its configuration offers (find-links or an extra index):"
        else
          echo "  PyPI's $torch for Linux is a CUDA build; pip preferred a CPU wheel that its"
          echo "  configuration offers (find-links or an extra index):"
        fi
        "$py" -m pip config list 2>/dev/null | grep -E 'find-links|index-url|no-index' |
          sed 's/^/    /' || echo "    (no find-links or index in pip's configuration)"
        echo "  To run it with pip's configuration files and PIP_* index settings left out:"
        echo "    $prefix $again"
        echo "  or to take torch from PyTorch's own index (a CUDA version your driver supports):"
        echo "    $pytorch_index"
      } >&2
      rm -f "$report"
      exit 1
    fi
  fi
  rm -f "$report"
  echo "$key" > "$built"
  "${pip[@]}" "${pins[@]}" -e ".[$extras]"
  echo "$want" > "$stamp"
  if [ "$cuda" = 1 ]; then
    echo "setup: $venv has torch $version (CUDA $cuda_version); $venv/bin/finetune env" \
      "shows what this machine offers"
  fi
fi
