#!/usr/bin/env bash
# GPU check for one H200 in under 8 minutes WITH a cold Triton cache: the stage timeouts add up
# to 458 s, plus at most 2 s each to kill a stage that ignores SIGTERM: 470 s. Stages (timeout):
#   env      20 s  versions, CUDA device, pytest/xdist, transformers architectures
#   warmup   85 s  compile the Triton kernels at every benchmarked shape (kernels.py --warmup
#                  and decode_step.py --warmup, concurrently: compiling is CPU work)
#   tests   150 s  the `gpu` tests (pytest, parallel with pytest-xdist when present; without
#                  pytest, bench/gpu_runner.py runs the fixture-free tests)
#   kernels  48 s  conv / paged attention / fused MoE bandwidth vs the device copy
#   decode   70 s  decode step, graph replay vs eager (LFM2-350M and ZAYA1 shapes); capture
#                  time (SUMMARY capture: one context bucket on the Triton path) and, for
#                  LFM2-350M, replay in that bucket vs the former per-context bucket
#                  (SUMMARY decode_bucket)
#   offline  85 s  workload b in bf16, ours vs transformers (LFM2-350M shape)
# Each stage writes $OUT/<stage>.log and appends its row and SUMMARY lines to $OUT/summary.md
# as soon as it ends, so a run cut short still reports what finished; the targets table
# (bench/gpu_summary.py) is printed last and appended to summary.md. NOTE: 7 files in all under
# $OUT (the device machine returns at most 8).
#
#   bash bench/gpu_check.sh            # on the GPU machine; results under $OUT (or a temp dir)
#   bash bench/gpu_check.sh --dry-run  # on CPU: every stage's imports and argument parsing only,
#                                      # with ray, pydantic, fastapi, prometheus_client hidden,
#                                      # plus the `compile` stage: every Triton kernel built for
#                                      # sm_90 at every published shape (bench/cuda_compile.py;
#                                      # $COMPILE_ARGS replaces its arguments)
#
# Runs from the source tree (PYTHONPATH=., no install): nothing on this path imports Ray.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NOTE: the GPU machine's interpreter with torch is `python3`; `python` may not exist there.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
LOGS="${OUT:-$(mktemp -d)}"
mkdir -p "$LOGS"
SUMMARY="$LOGS/summary.md"
DRYFLAG=""
if [ "$DRY" = 1 ]; then
  # NOTE: the GPU machine has none of these; the dry run proves no stage imports them.
  export SHORTCONV_HIDE_IMPORTS="ray,pydantic,fastapi,prometheus_client"
  export PYTHONPATH="bench/import_block:$PYTHONPATH"
  DRYFLAG=--dry-run
fi
export DRY PY LOGS DRYFLAG
declare -A STATUS

# stage NAME LIMIT CMD...: run CMD (a command or an exported function) under `timeout LIMIT`
# into $LOGS/NAME.log and record it at once. NOTE: timeout signals its whole process group, so
# a stage's background children end with it.
stage() {
  local name=$1 limit=$2 t0=$SECONDS rc status
  shift 2
  # NOTE: a dry run checks imports and arguments, not budgets; cold imports on a loaded 2-core
  # CPU can take longer than the whole stage does on the GPU machine.
  [ "$DRY" = 1 ] && limit=$((limit * 4))
  echo "== $name (limit ${limit}s): $*"
  timeout -k 2 "$limit" bash -c '"$@"' _ "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124) status="TIMEOUT" ;;
    *) status="FAILED-rc$rc" ;;
  esac
  STATUS[$name]=$status
  {
    echo "- **$name**: $status in $((SECONDS - t0)) s of $limit s"
    grep -E '^(SUMMARY|DRYRUN|CHECK) ' "$LOGS/$name.log" | sed 's/^/  - `/; s/$/`/'
  } >>"$SUMMARY"
  echo "   $name: $status in $((SECONDS - t0)) s"
  [ "$status" != ok ] && tail -n 30 "$LOGS/$name.log"
  return 0
}

env_probe() {
  "$PY" - <<'PYEOF'
import importlib.util, torch, triton
from shortconv.configs.hf.availability import transformers_lacks
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "triton", triton.__version__, "cuda", cuda,
      torch.cuda.get_device_name() if cuda else "")
for mod in ("transformers", "pytest", "xdist", "ray", "pydantic"):
    print(mod, "present" if importlib.util.find_spec(mod) else "absent")
for model_type in ("lfm2", "lfm2_moe", "zaya"):
    print("transformers", model_type, transformers_lacks(model_type) or "ok")
print("DRYRUN env ok")
PYEOF
}

warmup() {
  local tmp kpid krc drc
  tmp=$(mktemp -d)
  "$PY" bench/kernels.py --warmup $DRYFLAG >"$tmp/kernels" 2>&1 &
  kpid=$!
  "$PY" bench/decode_step.py --warmup $DRYFLAG >"$tmp/decode" 2>&1
  drc=$?
  wait "$kpid"
  krc=$?
  cat "$tmp/kernels" "$tmp/decode"
  rm -rf "$tmp"
  return $((drc != 0 || krc != 0))
}

gpu_tests() {
  set -o pipefail  # NOTE: a stage runs in a fresh `bash -c`, which does not inherit it
  local targets=(tests/gpu tests/kernels/test_conv1d_triton.py)
  if [ "$DRY" = 1 ]; then
    "$PY" -m pytest -q --collect-only -m gpu -p no:cacheprovider -o addopts= "${targets[@]}" \
      | tail -n 3 || return 1
    SHORTCONV_HIDE_IMPORTS="$SHORTCONV_HIDE_IMPORTS,pytest" "$PY" bench/gpu_runner.py --dry-run \
      || return 1
    echo "DRYRUN tests ok"
  elif "$PY" -c 'import pytest' 2>/dev/null; then
    local par=()
    "$PY" -c 'import xdist' 2>/dev/null && par=(-n 4)  # 4 processes compile kernels in parallel
    "$PY" -m pytest -v -m gpu -p no:cacheprovider -o addopts= "${par[@]}" "${targets[@]}"
  else
    "$PY" bench/gpu_runner.py --deadline 135
  fi
}

export -f env_probe warmup gpu_tests
echo "# GPU check $(date -u +%FT%TZ)$([ "$DRY" = 1 ] && echo ' (dry run)'), logs in $LOGS" \
  | tee "$SUMMARY"
printf '\n## Stages\n\n' >>"$SUMMARY"
stage env 20 env_probe
stage warmup 85 warmup
# NOTE: dry run only (not a GPU-run stage, so not in the 470 s budget): the CUDA build of every
# kernel, checked on CPU; fails on a compile failure or a bf16/fp16 spill.
[ "$DRY" = 1 ] && stage compile 600 "$PY" bench/cuda_compile.py ${COMPILE_ARGS:---summary}
stage tests 150 gpu_tests
stage kernels 48 "$PY" bench/kernels.py $DRYFLAG
stage decode 70 "$PY" bench/decode_step.py $DRYFLAG
stage offline 85 "$PY" bench/offline.py --shape lfm2-350m --device cuda --workloads b --runs 3 \
  $DRYFLAG

echo
echo "==================== GPU check summary ===================="
grep '^- \*\*' "$SUMMARY" | tr -d '*'
echo
"$PY" bench/gpu_summary.py "$LOGS" "dry_run=$DRY" "tests=${STATUS[tests]}" "kernels=${STATUS[kernels]}" \
  "decode=${STATUS[decode]}" "offline=${STATUS[offline]}"
[ "$DRY" = 1 ] && [ "${STATUS[compile]}" != ok ] && exit 1
for s in env warmup tests kernels decode offline; do
  [ "${STATUS[$s]}" = ok ] || exit 1
done
