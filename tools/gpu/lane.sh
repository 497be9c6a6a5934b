#!/usr/bin/env bash
# The GPU lane: one command on a lent GPU machine (docs/benchmarks.md, "GPU lane").
# Here first: bash tools/gpu/prepare.sh (fills .whl/; carry [".whl"]). There:
#   source tools/gpu/env.sh && bash tools/gpu/lane.sh [lane | bench [RUN ...] | all]
#
#   lane [ARGS]    (the default) the environment, then the GPU tests:
#                  python -m pytest -m cuda tests/gpu -q --durations=0   (budget: 8 minutes)
#                  ARGS in place of tests/gpu, to split the lane over two calls where it
#                  outgrows one: `lane --ignore=tests/gpu/test_vlm_cuda.py`, then
#                  `lane tests/gpu/test_vlm_cuda.py`
#   bench [RUN...] bench/run.py's GPU presets. RUN is PRESET[:full|lora][:CONTENDERS], e.g.
#                  gpu-llama1b   gpu-qwen0.5b-dense:lora   gpu-llama1b:full:finetune,same
#                  Without RUN, all eight: gpu-llama1b and gpu-qwen0.5b, each log-normal and
#                  -dense, full and LoRA. A preset is 4 contenders x 2 repeats (40 steps,
#                  dense 20); a device call is at most 10 minutes, so give one RUN per call,
#                  or half a preset (finetune,same then defaults,tuned) and pool the halves
#                  here with: python bench/table.py a.json b.json --markdown
#   vlm [lora|full] bench/vlm.py --preset gpu-llava0.8b: a vision-language sft run's tokens/s,
#                  images/s and GPU memory (CLIP ViT-L/336 + Qwen2.5-0.5B, random weights; LoRA default)
#   all            lane, then every bench run (a machine without a time limit per call)
#
# Everything lands in $OUT (default /tmp/finetune-gpu): environment.txt; lane.log, lane.xml
# (JUnit) and lane-figures.json (what the tests measured); bench-<preset>-<full|lora>
# [-<contenders>].json, .md and .log. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -n "${FINETUNE_GPU_ENV:-}" ] || source tools/gpu/env.sh || exit 2
PY=${FINETUNE_PYTHON:-python3}
OUT=${OUT:-/tmp/finetune-gpu}
mkdir -p "$OUT"
failed=0

environment() {
  {
    echo "== $(date -u +%FT%TZ) $(hostname)"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    else
      echo "nvidia-smi: not on PATH"
    fi
    # finetune's own account: versions, GPUs, what auto becomes here, and why.
    "$PY" -m finetune env
    "$PY" -c 'import inspect, torch.nn.attention.varlen as v
print("varlen_attn", inspect.signature(v.varlen_attn))' || echo "varlen_attn: none in this torch"
    "$PY" -m pytest --version
    # The wheel is this tree's code as prepare.sh last built it.
    stale=$(find finetune -name '*.py' -newer "$(ls .whl/finetune-*.whl | head -1)" | head -5)
    [ -z "$stale" ] || echo "warning: changed since .whl/finetune-*.whl was built" \
      "(run tools/gpu/prepare.sh again): $stale"
  } 2>&1 | tee -a "$OUT/environment.txt"
}

lane() {  # [PYTEST_ARGS]: tests/gpu where none
  local t0=$SECONDS tests=("$@")
  [ ${#tests[@]} -gt 0 ] || tests=(tests/gpu)
  echo "== lane: python -m pytest -m cuda ${tests[*]} -q --durations=0"
  FINETUNE_GPU_FIGURES="$OUT/lane-figures.json" timeout -k 15 "${LANE_TIMEOUT:-570}" \
    "$PY" -m pytest -m cuda "${tests[@]}" -q -n 0 --durations=0 -rs -p no:cacheprovider \
    --junitxml "$OUT/lane.xml" 2>&1 | tee "$OUT/lane.log"
  local rc=${PIPESTATUS[0]}
  echo "== lane: exit $rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

bench_one() {  # PRESET[:full|lora][:CONTENDERS]
  local preset kind contenders name t0 rc
  IFS=: read -r preset kind contenders <<< "$1"
  kind=${kind:-full}
  if [ "$kind" != full ] && [ "$kind" != lora ]; then
    echo "== bench $1: full or lora, not '$kind'" >&2; failed=$((failed + 1)); return
  fi
  name="bench-$preset-$kind${contenders:+-${contenders//,/_}}"  # $OUT takes [A-Za-z0-9._-]
  local args=(bench/run.py --preset "$preset" --out "$OUT/$name.json" --markdown
              --timeout "${CONTENDER_TIMEOUT:-300}")
  [ "$kind" = lora ] && args+=(--lora)
  [ -n "$contenders" ] && args+=(--contenders "$contenders")
  echo "== bench $1: $PY ${args[*]}"
  t0=$SECONDS
  timeout -k 15 "${BENCH_TIMEOUT:-570}" "$PY" "${args[@]}" > "$OUT/$name.log" 2>&1
  rc=$?
  if grep -q '^| contender' "$OUT/$name.log"; then
    sed -n '/^| contender/,$p' "$OUT/$name.log" | tee "$OUT/$name.md"
  fi
  echo "== bench $1: exit $rc in $((SECONDS - t0)) s (log $OUT/$name.log)"
  [ "$rc" = 0 ] || { tail -20 "$OUT/$name.log"; failed=$((failed + 1)); }
}

vlm() {  # [full|lora]: bench/vlm.py, a 0.8B LLaVA on one GPU (issue 27)
  local kind=${1:-lora} name args t0 rc
  name="bench-vlm-llava0.8b-$kind"
  args=(bench/vlm.py --preset gpu-llava0.8b --out "$OUT/$name.json")
  [ "$kind" = full ] && args+=(--full)
  echo "== vlm $kind: $PY ${args[*]}"
  t0=$SECONDS
  timeout -k 15 "${BENCH_TIMEOUT:-570}" "$PY" "${args[@]}" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -1 "$OUT/$name.log"
  echo "== vlm $kind: exit $rc in $((SECONDS - t0)) s (log $OUT/$name.log)"
  [ "$rc" = 0 ] || { tail -20 "$OUT/$name.log"; failed=$((failed + 1)); }
}

bench() {
  local runs=("$@")
  [ ${#runs[@]} -gt 0 ] || runs=(gpu-llama1b gpu-llama1b:lora gpu-llama1b-dense
                                  gpu-llama1b-dense:lora gpu-qwen0.5b gpu-qwen0.5b:lora
                                  gpu-qwen0.5b-dense gpu-qwen0.5b-dense:lora)
  for run in "${runs[@]}"; do bench_one "$run"; done
}

what=${1:-lane}
[ $# -gt 0 ] && shift
case "$what" in
  lane) environment; lane "$@" ;;
  bench) environment; bench "$@" ;;
  vlm) environment; vlm "$@" ;;
  all) environment; lane; bench; vlm lora ;;
  *) echo "usage: bash tools/gpu/lane.sh [lane [PYTEST_ARGS] | bench [PRESET[:full|lora][:CONTENDERS] ...]" \
          "| vlm [lora|full] | all]" >&2
     exit 2 ;;
esac
echo "== done: $failed step(s) failed; results in $OUT"
[ "$failed" = 0 ]
