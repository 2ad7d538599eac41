"""Print the SLURM job that ``lp-train -m hydra/launcher=submitit_slurm ...`` would submit, without submitting.

    python examples/slurm/dry_run.py trainer=multinode strategy=lp_ddp hydra.launcher.partition=gpu

It composes lp-train's config exactly as the real command would (so configuration errors show here)
and prints the sbatch script: with submitit installed (pip install "lightning-parallel[slurm]"), the
one submitit itself generates; otherwise an equivalent one written here. The real submission is

    lp-train -m hydra/launcher=submitit_slurm trainer=multinode strategy=lp_ddp

On the cluster srun starts ``tasks_per_node`` x ``nodes`` processes (the launcher config ties them to
``trainer.devices`` and ``trainer.num_nodes``); Lightning's SLURMEnvironment detects them, so no
process is started by Lightning or by lp-train.
"""

from __future__ import annotations

import shlex
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_parallel.cli.train import CONF_DIR
from lightning_parallel.config import register_configs, validate


def sbatch_script(launcher: dict, job_name: str, folder: str, command: str) -> str:
    params = dict(
        job_name=job_name,
        partition=launcher.get("partition"),
        time=launcher["timeout_min"],
        nodes=launcher["nodes"],
        ntasks_per_node=launcher["tasks_per_node"],
        cpus_per_task=launcher.get("cpus_per_task"),
        gpus_per_node=launcher.get("gpus_per_node"),
        mem=f"{launcher['mem_gb']}GB" if launcher.get("mem_gb") else None,
        qos=launcher.get("qos"),
        account=launcher.get("account"),
        signal_delay_s=launcher.get("signal_delay_s", 90),
        constraint=launcher.get("constraint"),
    )
    try:
        from submitit.slurm.slurm import _make_sbatch_string
    except ImportError:
        lines = ["#!/bin/bash", "", "# Parameters"]
        flags = {
            "job-name": job_name,
            "partition": params["partition"],
            "time": params["time"],
            "nodes": params["nodes"],
            "ntasks-per-node": params["ntasks_per_node"],
            "cpus-per-task": params["cpus_per_task"],
            "gpus-per-node": params["gpus_per_node"],
            "mem": params["mem"],
            "qos": params["qos"],
            "account": params["account"],
            "constraint": params["constraint"],
            "output": f"{folder}/%j_%t_log.out",
            "signal": f"USR2@{params['signal_delay_s']}",
        }
        lines += [f"#SBATCH --{k}={v}" for k, v in flags.items() if v is not None]
        lines += ["", "# command", f"srun --unbuffered --output {folder}/%j_%t_log.out {command}"]
        return "\n".join(lines) + "\n"
    return _make_sbatch_string(
        command=command, folder=folder, **{k: v for k, v in params.items() if v is not None}
    )


def main(overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            return_hydra_config=True,
            overrides=["hydra/launcher=submitit_slurm", "trainer=multinode", *overrides],
        )
    job_overrides = [o for o in overrides if not o.startswith("hydra")]
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    # resolve what the job would see; the sweep folder is only known at submission time
    for key in ("nodes", "tasks_per_node", "gpus_per_node"):
        launcher[key] = OmegaConf.select(cfg, f"hydra.launcher.{key}")
    task_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    if task_cfg.trainer.accelerator == "gpu":
        # the dry run happens on a login node without GPUs: skip only that check
        task_cfg.trainer.accelerator = "cuda_on_cluster"
    validate(task_cfg)
    folder = "multirun/<date>/<time>/.submitit/%j"
    command = "python -u -m submitit.core._submit " + folder
    print("# would submit (sbatch):")
    print(sbatch_script(launcher, cfg.hydra.job.name, folder, command))
    print("# each of the", launcher["nodes"] * launcher["tasks_per_node"], "tasks runs the Hydra job:")
    print("#   lp-train " + " ".join(shlex.quote(o) for o in ["trainer=multinode", *job_overrides]))
    print(
        f"# strategy {cfg.strategy._target_}, {launcher['nodes']} node(s) x {launcher['tasks_per_node']} "
        f"process(es), world size {launcher['nodes'] * launcher['tasks_per_node']}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
