#!/usr/bin/env bash
# The first run of syncdp ranks on a GPU, most important first, each under its own timeout; for
# the lent GPU machine (../shared/gpu/README.md). Run from the project root after its setup.sh;
# logs to $OUT/gpu.log as it goes. About 8 minutes at most (the bounds below), because sending
# the 36 parts takes 5 of the lease's 15 minutes:
#   1. benchmarks/gpu/check.py at np=2 (two ranks share the one GPU) and np=1, --expect gpu:
#      placement, the average against every rank's own gradients, identical replicas, Keras fit,
#      and the traced step's time with syncdp over without;
#   2. benchmarks/gpu/host_trip.py at np=2: what the copies to the host and back, the host call
#      and MPI each cost of the reduction's time on the GPU;
#   3. tests/parallel at np=2 with the GPU visible (the image has pytest);
#   4. the synthetic ResNet-50 with and without allreduce at np=2, one GPU shared;
#   5. the same host's 16 cores, GPU hidden: the tiny model's fixed cost at np=16 and 4.
# A dry run on a machine without a GPU (CHECK_EXPECT=any; about 4 minutes on the 2-core VM):
#   CHECK_EXPECT=any NP_CPU="2" bash benchmarks/gpu/first_run.sh
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
# The project is used from the working tree there (PYTHONPATH), not installed: the Horovod import
# names come with an install (a .pth file), so this adds the same line (test_parity.py needs it).
python -c "import horovod" 2>/dev/null || echo "import syncdp.horovod_names as _h; _h.install()" \
  > "$(python -c 'import site; print(site.getsitepackages()[0])')/syncdp-horovod.pth"
log "cores $(nproc); $(nvidia-smi -L 2>/dev/null | head -1 || true); load $(cut -d' ' -f1-3 /proc/loadavg)"
run 90 syncdp-run -np 2 python benchmarks/gpu/check.py --expect "$EXPECT"
run 45 syncdp-run -np 1 python benchmarks/gpu/check.py --expect "$EXPECT" --repeats 10
run 60 syncdp-run -np 2 python benchmarks/gpu/host_trip.py
if python -c "import pytest" 2>/dev/null; then
  run 120 syncdp-run -np 2 python -m pytest -q -p no:cacheprovider -rf tests/parallel
else
  log "pytest is not installed here: tests/parallel left out"
fi
run 75 syncdp-run -np 2 python benchmarks/synthetic.py --model resnet50 --batch-size 64 \
  --compare-no-comm --no-write --repeats 8
for n in ${NP_CPU:-16 4}; do
  CUDA_VISIBLE_DEVICES=-1 run 40 syncdp-run -np "$n" python benchmarks/step_cost.py \
    --model tiny --no-write --repeats 60
done
log "done; load $(cut -d' ' -f1-3 /proc/loadavg)"
