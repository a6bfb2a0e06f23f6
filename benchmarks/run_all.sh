#!/usr/bin/env bash
# Every benchmark at its default settings, one after another; each rewrites its table and plot
# under benchmarks/results/. About 8 minutes on a 2-core machine. Keep the machine otherwise
# idle: the figures are ratios measured side by side, but heavy load still adds noise.
set -euo pipefail
cd "$(dirname "$0")/.."

syncdp-run -np 2 python benchmarks/allreduce.py
syncdp-run -np 2 python benchmarks/allreduce.py --resnet50
syncdp-run -np 2 python benchmarks/overlap.py
python benchmarks/breakdown.py --np 2
syncdp-run -np 2 python benchmarks/step_cost.py
syncdp-run -np 2 python benchmarks/collectives.py
syncdp-run -np 2 python benchmarks/synthetic.py --compare-no-comm
syncdp-run -np 1 python benchmarks/synthetic.py --overhead --repeats 30
python benchmarks/synthetic.py --scaling 1,2
python benchmarks/compare.py
syncdp-run -np 2 python benchmarks/data_pipeline.py
