#!/usr/bin/env bash
# Sweeps with multi-process strategies: every job in one sweep folder, each with its own world size,
# and a summary table (sweep_summary.{csv,md,svg}) written in that folder at the end.
set -euo pipefail
LP_TRAIN=${LP_TRAIN:-lp-train}

# 1. a sweep defined in a config file (conf/experiment/sweep_strategies.yaml: strategy x devices)
$LP_TRAIN -m experiment=sweep_strategies hydra.sweep.dir=${OUT:-multirun}/from_config

# 2. the same kind of sweep on the command line; with the joblib launcher (pip install
#    "lightning-parallel[joblib]") add: hydra/launcher=joblib hydra.launcher.n_jobs=2
$LP_TRAIN -m strategy=lp_ddp trainer.devices=1,2 experiment=quick hydra.sweep.dir=${OUT:-multirun}/command_line

# 3. the pipeline schedules side by side on 2 processes (interleaved and ZBV: 2 chunks per rank, so 4 blocks)
$LP_TRAIN -m strategy=lp_pipeline_1f1b,lp_pipeline_interleaved,lp_pipeline_zb,lp_pipeline_zbv trainer.devices=2 \
    experiment=quick model.n_layer=4 hydra.sweep.dir=${OUT:-multirun}/schedules

cat ${OUT:-multirun}/{from_config,command_line,schedules}/sweep_summary.md
