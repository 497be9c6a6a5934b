# Source at the start of every command on a lent GPU machine, in the project root:
#   source tools/gpu/env.sh && bash tools/gpu/lane.sh
# Installs the wheels tools/gpu/prepare.sh put in .whl/ (carried with the tree) into
# $FINETUNE_SITE, once per machine and set of wheels, and finetune's own wheel every time
# (this tree's code, rebuilt by each prepare); puts them first on PYTHONPATH and PATH.
# Offline: the machine reaches no registry, and nothing is downloaded (the tiny models are
# config files, random weights).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export FINETUNE_SITE=${FINETUNE_SITE:-/tmp/finetune-site}
FINETUNE_PYTHON=${FINETUNE_PYTHON:-python3}
if ! ls .whl/finetune-*.whl >/dev/null 2>&1; then
  echo "env.sh: no .whl/finetune-*.whl here: run bash tools/gpu/prepare.sh on the development" \
       "machine and carry .whl" >&2
  return 2 2>/dev/null || exit 2
fi
_stamp=$(ls .whl | grep -v '^finetune-' | sort | cksum | cut -d' ' -f1)
if [ "$(cat "$FINETUNE_SITE/deps/.wheels" 2>/dev/null)" != "$_stamp" ]; then
  rm -rf "$FINETUNE_SITE/deps"
  "$FINETUNE_PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$FINETUNE_SITE/deps" $(ls .whl/*.whl | grep -v '/finetune-') &&
    echo "$_stamp" > "$FINETUNE_SITE/deps/.wheels"
fi
rm -rf "$FINETUNE_SITE/finetune"
"$FINETUNE_PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$FINETUNE_SITE/finetune" .whl/finetune-*.whl
unset _stamp
export PYTHONPATH=$FINETUNE_SITE/finetune:$FINETUNE_SITE/deps${PYTHONPATH:+:$PYTHONPATH}
export PATH=$FINETUNE_SITE/finetune/bin:$FINETUNE_SITE/deps/bin:$PATH
export FINETUNE_GPU_ENV=1
