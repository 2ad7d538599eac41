#!/usr/bin/env bash
# lp-train on your own LightningModule and DataModule, unmodified: name them with _target_ and add
# their arguments with ++model.<arg>=... ("++": add or override; keys the default model's group had are dropped if your class
# does not take them). Your package must be importable: run from its folder, or set PYTHONPATH.
set -euo pipefail
LP_TRAIN=${LP_TRAIN:-lp-train}
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"

$LP_TRAIN \
  model._target_=my_project.model.SineRegressor ++model.width=32 \
  data._target_=my_project.model.SineData ++data.batch_size=64 \
  strategy=lp_ddp trainer.devices=2 trainer.max_steps=60 trainer.val_check_interval=30 \
  hydra.run.dir=${OUT:-outputs}/hydra_app
