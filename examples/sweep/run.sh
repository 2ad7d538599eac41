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

cat ${OUT:-multirun}/from_config/sweep_summary.md ${OUT:-multirun}/command_line/sweep_summary.md
