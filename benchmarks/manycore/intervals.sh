#!/usr/bin/env bash
# Issue 34's figures on the 16-core machine, with intervals: the CNN step (syncdp, naive, barrier
# / no communication) beside PyTorch DDP / no_sync, the tiny model's fixed cost per step, and
# how soon a collective ends after the last rank arrives (wait_latency.py).
# Run from the project root after ../shared/manycore/setup.sh; logs to $OUT/intervals.log.
# NPS and REPEATS shrink it for a dry run on a small machine (NPS="2" REPEATS=3). With
# REPEATS=16 on 16 cores one pass takes about 6 minutes: more than half of a lease.
set -u
# mpirun as root (setup.sh says so too; a dry run here may not have); --oversubscribe below, in
# case the host's slots count fewer than -np (DDP printed nothing at np=8 and 16 once).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
NPS=${NPS:-"4 8 16"}
R=${REPEATS:-16}
L=${OUT:-/tmp}/intervals.log
log() { echo "== $(date +%T) $*" | tee -a "$L"; }
run() {
  local t=$1; shift; log "$*"
  timeout -k 5 "$t" "$@" 2>&1 | grep -av -e oneDNN -e cpu_feature_guard -e 'rebuild TensorFlow' \
    -e cuda -e 'absl::' -e 'WARNING: All log' | tee -a "$L"
}
log "cores $(nproc); $(lscpu | grep 'Model name' | head -1); load $(cut -d' ' -f1-3 /proc/loadavg)"
for pass in 1 2; do
  run 200 python benchmarks/breakdown.py --np "${NPS// /,}" --no-write --repeats "$R"
  for n in $NPS; do
    run 150 mpirun -np "$n" --oversubscribe --bind-to none python benchmarks/manycore/ddp_cnn.py --repeats "$R"
  done
  [ "$pass" = 2 ] && break
  for n in 2 $NPS; do
    run 60 syncdp-run -np "$n" python benchmarks/step_cost.py --model tiny --no-write \
      --repeats $((R * 5))
  done
  for n in $NPS; do  # how late a collective ends when ranks arrive apart (seconds each)
    run 60 syncdp-run -np "$n" python benchmarks/wait_latency.py --no-write --repeats "$R"
  done
done
log "done; load $(cut -d' ' -f1-3 /proc/loadavg)"
