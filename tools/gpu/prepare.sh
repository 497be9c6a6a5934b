#!/usr/bin/env bash
# Before a call to a lent GPU machine, on this (development) machine, from anywhere in the
# project: fills .whl/ with what the GPU image lacks, as wheels, plus a wheel of finetune
# built from this tree. The machine reaches no package registry; .whl/ travels with the
# tree (carry [".whl"]), which may hold 64 MiB in all, and tools/gpu/env.sh installs it
# there. docs/benchmarks.md, "GPU lane".
#
# The GPU image has Python 3.12, torch 2.11 (CUDA 13), accelerate, peft, pyarrow and numpy,
# but an older transformers and no trl, datasets, pydantic, deepspeed or bitsandbytes.
# Carried here, at the versions of constraints.txt (what the CPU suite passed with):
#   finetune's own needs   transformers trl datasets peft pydantic (+ its core and helpers),
#                          dill and multiprocess (datasets), liger-kernel (sft's fused kernels)
#   the QLoRA test         bitsandbytes: its wheel (43 MB) holds a library per CUDA and ROCm
#                          release; only CUDA 13's are kept (BNB_CUDA="130 132", the
#                          image's torch is cu130), ~3 MB, its RECORD rewritten to match
#   the test runner        pytest pytest-xdist execnet pluggy iniconfig packaging pygments
#   Qwen2-VL's processor   torchvision, the release built for the image's torch (2.11.0+cu130:
#                          0.26.0, ~8 MB; TORCHVISION=torchvision==X for another image)
# Not carried: deepspeed (no GPU test uses it) and flash-attn (no wheel for this stack: the
# lane checks finetune_varlen, torch's own kernel).
#   bash tools/gpu/prepare.sh           # then every device call: carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/../.."

# .whl/ stays out of git (it is machine-made and large), whatever .gitignore says.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

py=.venv/bin/python
[ -x "$py" ] || { echo "prepare: no .venv (bash setup.sh first)" >&2; exit 2; }
pin() {  # name==version from constraints.txt (- and _ alike), else the bare name
  local line
  line=$(grep -i -m1 -E "^${1//[-_]/[-_]}==" constraints.txt || true)
  echo "${line:-$1}"
}
fetch() {  # wheels for the GPU machine's Python and platform, never sources
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}

mkdir -p .whl
rm -f .whl/finetune-*.whl
fetch $(for p in transformers trl datasets peft pydantic pydantic-core annotated-types \
                 typing-inspection dill multiprocess liger-kernel bitsandbytes \
                 pytest pytest-xdist execnet pluggy iniconfig packaging pygments; do pin "$p"; done) \
  "${TORCHVISION:-torchvision==0.26.0}"
# bitsandbytes for the image's CUDA only (bitsandbytes loads libbitsandbytes_cuda<torch's
# CUDA version>.so). pip fetches the whole wheel again on each run (the slimmed one has
# another hash than the index gives), and it is cut again.
"$py" - .whl/bitsandbytes-*.whl ${BNB_CUDA:-130 132} <<'PY'
import os, re, sys, zipfile
wheel, keep = sys.argv[1], {"cpu", *("cuda" + v for v in sys.argv[2:])}
def wanted(name):
    lib = re.fullmatch(r"bitsandbytes/libbitsandbytes_(\w+)\.so", name)
    return lib is None or lib.group(1) in keep
with zipfile.ZipFile(wheel) as src:
    if all(wanted(n) for n in src.namelist()):
        sys.exit(0)
    with zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if not wanted(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line + "\n" for line in data.decode().splitlines()
                               if wanted(line.split(",")[0])).encode()
            out.writestr(info, data)
os.replace(wheel + ".tmp", wheel)
print("bitsandbytes: kept the libraries for", ", ".join(sorted(keep)))
PY
# finetune itself, from this tree as git sees it (uncommitted changes included, ignored
# files not), built in a copy: nothing stale from an earlier build/ gets in, and nothing is
# written into the tree. The venv's setuptools when new enough (offline), else an isolated
# build.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -co --exclude-standard -z | tar -c --null -T - -f - | tar -x -C "$src" -f -
"$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$src" 2>/dev/null ||
  "$py" -m pip wheel -q --no-deps -w .whl "$src"

# Older versions of the same packages, left by an earlier run with other pins: keep the
# newest file per package (the pins above are what was just fetched).
ls .whl/*.whl | sed -E 's#.*/([^-]+)-.*#\1#' | sort | uniq -d | while read -r name; do
  ls -t .whl/"$name"-*.whl | tail -n +2 | xargs rm -f
done

ls -1 .whl
du -sh .whl
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null |
  tail -1 | cut -f1)
whl_bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
mib() { echo $(( ($1 + 1048575) / 1048576 )); }
echo "carried: the tree $(mib "$tree_bytes") MiB + .whl $(mib "$whl_bytes") MiB" \
  "= $(mib $((tree_bytes + whl_bytes))) MiB of the 64 MiB a device call takes"
[ $((tree_bytes + whl_bytes)) -lt $((64 * 1048576)) ] ||
  { echo "prepare: over the 64 MiB a device call carries" >&2; exit 1; }
