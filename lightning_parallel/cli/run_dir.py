"""The part of a run's default output folder that keeps runs started in the same second apart.

``conf/config.yaml`` names the folder ``outputs/<date>/<time>-${lp_run_id:}`` (and the sweep folder the
same way): Hydra's ``${now:}`` has a resolution of one second, so without it two runs started in the same
second would share one folder, one overwriting the other's ``summary.json`` and their checkpoints mixed.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

__all__ = ["RESOLVER", "run_id", "register_run_id"]

RESOLVER = "lp_run_id"


def run_id() -> str:
    """This process's id; where every rank runs ``lp-train`` itself (torchrun, srun), the launch's id that
    they share, so that they agree on the folder (the time may still differ: give them ``hydra.run.dir``)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ["TORCHELASTIC_RUN_ID"]
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    return str(os.getpid())


def register_run_id() -> None:
    """Register ``${lp_run_id:}``: cached, as Hydra's ``now`` is, so that a sweep's jobs (composed again,
    with the cache copied, in joblib workers too) resolve the sweep folder as the sweep did."""
    OmegaConf.register_new_resolver(RESOLVER, run_id, use_cache=True, replace=True)
