#!/usr/bin/env bash
# Run from the project root after ../shared/manycore/setup.sh; writes $OUT/figures.log.
# Issue 31's figures on the 16-core machine, most important first; each step bounded.
set -u
L=$OUT/figures.log
log() { echo "== $(date +%T) $*" | tee -a "$L"; }
run() { local t=$1; shift; log "$*"; timeout -k 5 "$t" "$@" 2>&1 | grep -av -e 'oneDNN' -e 'cpu_feature_guard' -e 'rebuild TensorFlow' -e 'cuda' -e 'absl::' -e 'WARNING: All log' | tee -a "$L"; }
log "cores $(nproc); $(lscpu | grep 'Model name' | head -1)"
run 300 python benchmarks/breakdown.py --np 4,8,16 --no-write --repeats 5
for n in 4 8 16; do run 60 mpirun -np $n --bind-to none python /tmp/stage/ddp_cnn.py; done
for n in 8 16; do
  run 90 syncdp-run -np $n python benchmarks/allreduce.py --resnet50 --no-write
  run 60 mpirun -np $n --bind-to none python /tmp/stage/ddp_resnet50.py --skip-step
done
run 120 env OMPI_MCA_mpi_yield_when_idle=1 python benchmarks/breakdown.py --np 16 --no-write --repeats 5
run 120 syncdp-run -np 2 python benchmarks/overlap.py --intra-threads 4 --no-write --repeats 5
run 60 mpirun -np 2 --bind-to none python /tmp/stage/ddp_resnet50.py --threads 4
log done
