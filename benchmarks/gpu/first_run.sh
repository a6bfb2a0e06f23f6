#!/usr/bin/env bash
# The first run of syncdp ranks on a GPU, most important first, each under its own timeout; for
# the lent GPU machine (../shared/gpu/README.md). Run from the project root after its setup.sh;
# logs to $OUT/gpu.log as it goes. About 8 minutes at most; each line below says its bound.
#   1. benchmarks/gpu/check.py at np=2 (two ranks share the one GPU) and np=1, --expect gpu:
#      placement, the average against every rank's own gradients, identical replicas, Keras fit,
#      and the traced step's time with syncdp over without;
#   2. the synthetic ResNet-50 with and without allreduce at np=2, one GPU shared;
#   3. tests/parallel at np=2 on the GPU, when pytest was sent along (add its wheels to the last
#      part's w/: pip download --no-deps -d .gpu/g_XX/w pytest pluggy iniconfig packaging).
# A dry run on a machine without a GPU (3 minutes on the 2-core VM):
#   CHECK_EXPECT=any bash benchmarks/gpu/first_run.sh
set -u
L=${OUT:-/tmp}/gpu.log
EXPECT=${CHECK_EXPECT:-gpu}
log() { echo "== $(date +%T) $*" | tee -a "$L"; }
run() {
  local t=$1; shift; log "$*"
  timeout -k 5 "$t" "$@" 2>&1 | grep -av -e oneDNN -e cpu_feature_guard -e 'rebuild TensorFlow' \
    -e 'absl::' -e 'WARNING: All log' | tee -a "$L"
  log "exit ${PIPESTATUS[0]}"
}
log "cores $(nproc); $(nvidia-smi -L 2>/dev/null | head -1 || true); load $(cut -d' ' -f1-3 /proc/loadavg)"
run 150 syncdp-run -np 2 python benchmarks/gpu/check.py --expect "$EXPECT"
run 90 syncdp-run -np 1 python benchmarks/gpu/check.py --expect "$EXPECT" --repeats 10
run 150 syncdp-run -np 2 python benchmarks/synthetic.py --model resnet50 --batch-size 64 \
  --compare-no-comm --no-write --repeats 10
if python -c "import pytest" 2>/dev/null; then
  run 150 syncdp-run -np 2 python -m pytest -x -q -p no:cacheprovider tests/parallel
else
  log "pytest is not installed here: tests/parallel left out"
fi
log "done; load $(cut -d' ' -f1-3 /proc/loadavg)"
