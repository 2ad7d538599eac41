"""``lp-train``: the Hydra main job. Trains ``cfg.model`` on ``cfg.data`` with ``cfg.strategy``.

    lp-train                                   # CharGPT, lp_ddp, 2 CPU processes
    lp-train strategy=lp_dp trainer.devices=4
    lp-train strategy=auto trainer.devices=4        # the layout planner chooses (cli/auto_strategy.py)
    lp-train model._target_=my_pkg.MyModule data._target_=my_pkg.MyData
    lp-train -m strategy=lp_ddp,lp_dp trainer.devices=1,2

Each run writes ``summary.json`` into its Hydra output folder (see ``RunRecorder``). Under ``-m`` a
failing job is recorded there with status "failed" and the sweep goes on; the sweep summary
(``cli/sweep.py``) lists it and the sweep exits non-zero.

A run's exit status: 0 completed, 1 failed, 2 an invalid configuration (nothing started), 75
(``EXIT_PREEMPTED``) stopped by SIGTERM after saving a checkpoint it resumes from (docs/lp_train.md says
why 75).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.auto_strategy import register_planner_ranks
from lightning_parallel.cli.choices import register_choices
from lightning_parallel.cli.quiet import quiet_third_party
from lightning_parallel.cli.run_dir import register_run_id
from lightning_parallel.config.store import quiet_schema_matching_warning

__all__ = [
    "main",
    "train",
    "instantiate_user",
    "SUMMARY_KEYS",
    "CONF_DIR",
    "EXIT_FAILED",
    "EXIT_INVALID_CONFIG",
    "EXIT_PREEMPTED",
]

log = logging.getLogger("lp-train")

# also in joblib workers, which import this module (the task function) before composing their job
quiet_schema_matching_warning()
quiet_third_party()
register_run_id()
register_planner_ranks()  # planner.top_k's sweep (conf/strategy/auto.yaml)

# conf/ ships inside the package (lightning_parallel/conf links to the repo's conf/ and is copied as package
# data on install). An absolute path, because Hydra's pkg:// provider needs an __init__.py there.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
register_choices(CONF_DIR)  # lp-train --help lists them

EXIT_FAILED = 1
EXIT_INVALID_CONFIG = 2
# sysexits.h's EX_TEMPFAIL ("a temporary failure: the user is invited to retry"): non-zero, so that torchrun
# and Kubernetes restart the job, distinct from a failure and from 128 + a signal (killed without a save)
EXIT_PREEMPTED = 75

# a job of this process was preempted: a sweep starts none of its remaining jobs (the scheduler's SIGKILL
# follows the SIGTERM within its grace period)
_PREEMPTED_IN_THIS_PROCESS = False

# what every summary.json holds (tests and the sweep summary rely on these)
SUMMARY_KEYS = (
    "status",
    "strategy",
    "world_size",
    "devices",
    "num_nodes",
    "global_step",
    "train_loss",
    "val_loss",
    "samples_per_second",
    "checkpoint",
    "resumable",
    "overrides",
    "output_dir",
)


# what a rank sees when a peer died: then the peer's own error is the cause
_COMMUNICATION_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "gloo",
    "NCCL",
)


def _explicit_keys(section: str) -> set[str]:
    """Keys of ``section`` set on the command line (``model.lr=1`` -> {"lr"})."""
    from hydra.core.hydra_config import HydraConfig

    keys = set()
    if HydraConfig.initialized():
        for override in HydraConfig.get().overrides.task:
            key = str(override).split("=", 1)[0].lstrip("+~")
            if key.startswith(section + "."):
                keys.add(key[len(section) + 1 :].split(".", 1)[0])
    return keys


def instantiate_user(node: DictConfig, section: str) -> Any:
    """Instantiate a user's class from ``node`` (``_target_`` plus keywords), unmodified.

    ``model._target_=my.Module`` keeps the other keys of the default group file (``n_layer`` ...). Those
    the class does not accept are left out (and logged); keys set on the command line are always passed,
    so a misspelt one fails with the class's own error. A ``ValueError`` or ``TypeError`` of the class's
    constructor (arguments it refuses) is a ``ConfigError``: the run has not started.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import get_class, instantiate

    from lightning_parallel.config import ConfigError

    target = node._target_
    cls = get_class(target)
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        explicit = _explicit_keys(section)
        dropped = sorted(k for k in kwargs if k not in params and k not in explicit)
        if dropped:
            log.info(
                "%s: %s takes no %s (defaults of the %s group); not passed",
                section,
                target,
                ", ".join(dropped),
                section,
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
    config = OmegaConf.create({"_target_": target})
    for key, value in kwargs.items():
        config[key] = node[key]
    try:
        return instantiate(config, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        raise ConfigError.of([f"{section}: {target} refused its arguments: {cause}"]) from err


def _trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(kwargs, dict)
    kwargs.update(kwargs.pop("extra", None) or {})
    return kwargs


def _global_rank(trainer: Any) -> int:
    if trainer is not None:
        return int(trainer.global_rank)
    from lightning.fabric.utilities.rank_zero import _get_rank

    return int(_get_rank() or 0)


def train(cfg: DictConfig) -> dict[str, Any]:
    """The task function: one run. Returns the summary (written to ``summary.json`` by global rank 0)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lightning_parallel.cli.auto_strategy import auto_problems, compare, is_auto, plan_and_compose
    from lightning_parallel.cli.json_file import write_json
    from lightning_parallel.cli.run_report import PLOT_FILE, run_table, svg_curves
    from lightning_parallel.config import ConfigError, validate
    from lightning_parallel.strategies.launcher import RankFailedError, finish_job, is_launched_rank

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    summary: dict[str, Any] = {
        "status": "running",
        "strategy": hydra_cfg.runtime.choices.get("strategy"),
        "strategy_target": cfg.strategy.get("_target_"),
        "model": cfg.model.get("_target_"),
        "data": cfg.data.get("_target_"),
        "devices": OmegaConf.to_container(cfg.trainer, resolve=True)["devices"],
        "num_nodes": cfg.trainer.num_nodes,
        "overrides": list(hydra_cfg.overrides.task),
        "output_dir": str(out_dir),
        "world_size": None,
        "global_step": 0,
        "train_loss": None,
        "val_loss": None,
        "samples_per_second": None,
        "checkpoint": None,
        "resumable": False,
    }
    trainer = None
    started = time.perf_counter()
    global _PREEMPTED_IN_THIS_PROCESS
    try:
        if _PREEMPTED_IN_THIS_PROCESS:
            summary.update(
                status="preempted", error="not started: an earlier job of this sweep was preempted"
            )
        else:
            validate(cfg)
            found = auto_problems(cfg)  # strategy=auto's settings, planner.* without it
            if found:
                raise ConfigError.of(found)
            if is_auto(cfg):  # the planner's layout, as if its overrides had been given (docs/planner.md)
                cfg, planned = plan_and_compose(cfg, instantiate_user)
                chosen = next(o for o in planned["overrides"] if o.startswith("strategy="))
                summary.update(strategy=chosen.split("=", 1)[1], strategy_target=cfg.strategy._target_)
                summary["planner"] = planned
                validate(cfg)
            summary.update(_fit(cfg, out_dir))
            trainer = summary.pop("_trainer")
            summary["status"] = "completed"
        if summary.get("preempted_at"):
            _PREEMPTED_IN_THIS_PROCESS = True
            summary.update(status="preempted", resumable=True, resume=_resume_command(hydra_cfg, summary))
            log.warning(
                "preempted (SIGTERM): saved %s at step %s; resume with\n  %s",
                summary["preempted_at"],
                summary["global_step"],
                summary["resume"],
            )
    except ConfigError as err:
        summary.update(status="failed", error=str(err))
        log.error("%s", err)
    except Exception as err:  # the job failed: record it (a sweep goes on)
        trainer = getattr(err, "_lp_trainer", None)
        summary.update(getattr(err, "_lp_results", {}))
        summary.update(status="failed", error=f"{type(err).__name__}: {err}")
        log.error("run failed: %s\n%s", err, traceback.format_exc())
    finally:
        try:
            finish_job(job_failed=summary["status"] == "failed")
        except RankFailedError as err:
            summary["status"] = "failed"
            own = summary.get("error", "")
            if str(err) in own:  # already the reason this process failed
                pass
            elif not own or any(w in own for w in _COMMUNICATION_ERRORS):
                # a child failed first; this process only saw its peer vanish: the child's error leads
                summary["error"] = (str(err) + "\n" + own).strip()
            else:
                summary["error"] = (own + "\n" + str(err)).strip()
            log.error("%s", err)
    summary["wall_seconds"] = round(time.perf_counter() - started, 3)
    if summary.get("planner"):
        summary["planner"] = compare(summary["planner"], summary)
    if _global_rank(trainer) == 0:
        write_json(out_dir / cfg.summary_file, summary)
        plot = out_dir / PLOT_FILE if summary.get("global_step") else None
        if plot is not None:
            plot.write_text(svg_curves(summary))
        log.info("%s\n%s", summary["status"], run_table(summary, out_dir / cfg.summary_file, plot))
    if _global_rank(trainer) != 0:
        # a rank > 0 closes its process group while the interpreter is whole (the launching rank's job end does
        # it for its own); ``main`` then ends a rank that our launcher started without the interpreter's
        # finalization (``_exit_launched_rank``)
        from lightning_parallel.strategies.launcher import _destroy_process_group

        _destroy_process_group()
    code = exit_status(summary)
    if code and not multirun and not (summary["status"] == "preempted" and is_launched_rank()):
        sys.exit(code)  # (a rank our launcher started exits 0 when preempted: its launching rank reports)
    return summary


def _weights_only(cfg: DictConfig) -> dict[str, Any]:
    """``fit``'s ``weights_only`` when the config sets one; refused before anything is built where Lightning's
    fit has no such argument."""
    from lightning_parallel.checkpointing.trust import FIT_TAKES_WEIGHTS_ONLY

    weights_only = cfg.get("weights_only")
    if weights_only is None:
        return {}
    if not FIT_TAKES_WEIGHTS_ONLY:
        raise ValueError(
            f"weights_only={weights_only}: this Lightning's Trainer.fit takes no weights_only (it arrived in "
            "Lightning 2.6); remove it, or install lightning>=2.6"
        )
    return {"weights_only": weights_only}


def exit_status(summary: dict[str, Any]) -> int:
    """The exit status of a run with this summary (``EXIT_*``; 0 when it completed)."""
    if summary["status"] == "completed":
        return 0
    if summary["status"] == "preempted":
        return EXIT_PREEMPTED
    invalid = summary.get("error", "").startswith("invalid lp-train configuration")
    return EXIT_INVALID_CONFIG if invalid else EXIT_FAILED


def _resume_command(hydra_cfg: Any, summary: dict[str, Any]) -> str:
    """The command that continues a preempted run from its checkpoint, in the same folder."""
    kept = [o for o in hydra_cfg.overrides.task if not str(o).startswith(("ckpt_path=", "hydra.run.dir="))]
    return " ".join(
        ["lp-train", *kept, f"ckpt_path={summary['preempted_at']}", f"hydra.run.dir={summary['output_dir']}"]
    )


def _fit(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    from hydra.utils import instantiate
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import lightning_parallel  # noqa: F401  (registers the strategy names)
    from lightning_parallel.cli.recorder import ProgressPrinter, RunRecorder, SamplesProgressBar
    from lightning_parallel.memory import MemoryReport
    from lightning_parallel.memory.accounting import reset_peak_rss
    from lightning_parallel.strategies.launcher import install

    untrusted = _weights_only(cfg)
    reset_peak_rss()  # a sweep runs its jobs one after another in this process: each job's peak is its own
    seed_everything(cfg.seed, workers=True, verbose=False)
    model = instantiate_user(cfg.model, "model")
    data = instantiate_user(cfg.data, "data")
    strategy = instantiate(cfg.strategy, _convert_="all") if "_target_" in cfg.strategy else cfg.strategy
    recorder = RunRecorder(results_file=out_dir / ".run_results.json")
    bar = cfg.trainer.enable_progress_bar
    bar = sys.stderr.isatty() if bar is None else bar
    progress = SamplesProgressBar(recorder) if bar else ProgressPrinter(recorder, cfg.progress_every_n_steps)
    callbacks: list[Any] = [recorder, progress]
    if getattr(strategy, "memory_report", True):  # before the recorder, which reads it at the end of fit
        callbacks.insert(0, MemoryReport())
    if cfg.checkpoint.enabled:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out_dir / "checkpoints",
                save_last=cfg.checkpoint.save_last,
                every_n_train_steps=cfg.checkpoint.every_n_train_steps,
            )
        )
    trainer = Trainer(
        strategy=strategy,
        callbacks=callbacks,
        default_root_dir=str(out_dir),
        logger=CSVLogger(str(out_dir), name="csv"),
        enable_checkpointing=cfg.checkpoint.enabled,
        **{**_trainer_kwargs(cfg), "enable_progress_bar": bool(bar)},
    )
    install(trainer.strategy)  # Lightning's built-in ddp gets the sweep-safe launcher too
    try:
        trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path, **untrusted)
    except Exception as err:
        err._lp_trainer = trainer  # type: ignore[attr-defined]
        err._lp_results = recorder.results(trainer)  # type: ignore[attr-defined]
        raise
    results = recorder.load_results() or recorder.results(trainer)
    (out_dir / ".run_results.json").unlink(missing_ok=True)
    return {**results, "_trainer": trainer}


def _entry_command() -> list[str]:
    """How a child rank starts this same app: ``python -m lightning_parallel.cli.train`` + config flags."""
    command = [sys.executable, "-m", "lightning_parallel.cli.train"]
    argv = sys.argv[1:]
    flags = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
    for i, arg in enumerate(argv):
        if arg.split("=", 1)[0] in flags:
            command.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                command.append(argv[i + 1])
    return command


def _per_rank_logs_when_launched_externally() -> None:
    """Under torchrun or srun every rank runs ``lp-train``: give ranks > 0 their own log, no .hydra copy.

    (Ranks that our own launcher starts get the same overrides in their command.)
    """
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    if rank is None or not rank.isdigit() or int(rank) == 0:
        return
    if not any(arg.startswith("hydra.job.name=") for arg in sys.argv[1:]):
        sys.argv += [f"hydra.job.name=train_rank{rank}", "hydra.output_subdir=null"]


def main() -> Optional[Any]:
    """Console script ``lp-train``."""
    import hydra

    from lightning_parallel.config import register_configs
    from lightning_parallel.strategies.launcher import ENTRY_ENV, is_launched_rank

    os.environ[ENTRY_ENV] = json.dumps(_entry_command())
    # like ``python -m``: the user's own modules in the current folder can be named by ``_target_``
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    _per_rank_logs_when_launched_externally()
    register_configs()
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(train)
    if not is_launched_rank():
        return app()
    try:
        app()
    except SystemExit as end:
        _exit_launched_rank(end.code)
    _exit_launched_rank(0)


def _exit_launched_rank(code: Any) -> None:
    """End a rank that our launcher started, its job done and its files written: flush the logs and the
    output, then leave without the interpreter's finalization. There, torch's gloo teardown was seen to abort
    a finished rank of Lightning's ``ddp`` (SIGABRT, 'terminate called without an active exception', no
    Python frame), which failed a completed job in a sweep. The launching rank exits normally."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if isinstance(code, str):
        print(code, file=sys.stderr, flush=True)
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


if __name__ == "__main__":
    main()
