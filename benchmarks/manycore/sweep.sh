#!/usr/bin/env bash
# The settings sweep of docs/performance-16core.md, on the 16-core machine (../shared/manycore).
set -u
L=$OUT/sweep.log
log() { echo "== $(date +%T) $*" | tee -a "$L"; }
run() { local t=$1; shift; log "$*"; timeout -k 5 "$t" "$@" 2>&1 | grep -a -e relative -e '^  [a-z]' -e Error -e rror: | grep -av 'OSC UCX' | tee -a "$L"; }
B="python benchmarks/breakdown.py --no-write --repeats 5 --np"
run 60 env $B 8
run 60 env SYNCDP_SHARED_MEMORY=off $B 8
run 60 env SYNCDP_FIRST_BUCKET_BYTES=67108864 SYNCDP_FUSION_THRESHOLD=67108864 $B 8
run 70 env $B 16
run 60 env OMPI_MCA_mpi_yield_when_idle=1 $B 8
log done
