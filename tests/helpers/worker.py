"""One rank of a multi-process test run: ``python -m tests.helpers.worker SPEC.json``.

The parent (``tests/helpers/harness.py``) starts one of these per rank with the variables a launcher
such as torchrun would set (MASTER_ADDR/PORT, WORLD_SIZE, NODE_RANK, LOCAL_RANK), so Lightning treats
the processes as created externally and runs an ordinary ``Trainer.fit`` in each. Several cases run
one after another in the same processes to save start-up time. A case with ``"compile": {...}`` fits
``torch.compile(model, **that)`` and returns what dynamo did (``dynamo_record``) and what set-up said about
the compiled model (its warnings that name "under torch.compile"); ``"record_dynamo": True`` returns the same
for a model the strategy compiles (its ``compile`` option).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_parallel.materialize.share import release_freed_host_memory
from lightning_parallel.memory.accounting import peak_rss_bytes, rss_bytes, unique_storage_bytes

__all__ = ["run_case", "load_object", "threads_after_destroy"]


def load_object(path: str) -> Any:
    """``"package.module:attr"`` -> the attribute."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(float(loss))


def reset_peak_resident() -> None:
    """Give freed heap back to the system and restart the peak (VmHWM) from the current resident memory,
    so that a case measures its own peak, not an earlier case's in the same process."""
    gc.collect()
    release_freed_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SetupMemory(Callback):
    """The peak resident memory from before the model is built to the first training step and to the end of
    training, and the bytes of the parameters the rank holds at the first step (unique storages, meta
    excluded; the strategy's own shards of them included)."""

    def __init__(self, rss_before: int) -> None:
        self.rss_before = rss_before
        self.peak_at_first_step: int | None = None
        self.parameter_bytes: int | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak_at_train_end = peak_rss_bytes()  # before the strategy gives the module back whole

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.peak_at_first_step is None:
            self.peak_at_first_step = peak_rss_bytes()
            self.rss_at_first_step = rss_bytes()
            held = getattr(trainer.strategy, "held_parameters", list)()  # zero_stage=3's shards
            self.parameter_bytes = unique_storage_bytes([*pl_module.parameters(), *held])

    def figures(self) -> dict:
        growth = None if self.peak_at_first_step is None else self.peak_at_first_step - self.rss_before
        return {
            "setup_peak_growth": growth,
            "rss_growth_at_first_step": growth and self.rss_at_first_step - self.rss_before,
            "peak_at_end": getattr(self, "peak_at_train_end", peak_rss_bytes()) - self.rss_before,
            "parameter_bytes": self.parameter_bytes,
        }


def reset_dynamo() -> None:
    """Forget what dynamo compiled and counted before, so that a compiled case counts its own graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def dynamo_record() -> dict:
    """What dynamo did during the case: its statistics (``unique_graphs``, ``calls_captured``, ...) and
    each graph break's reason with the frames dynamo was tracing when it broke (file, line, function)."""
    from torch._dynamo.utils import counters, graph_break_reasons

    return {
        "stats": dict(counters["stats"]),
        "counters": {kind: dict(counts) for kind, counts in counters.items()},
        "graph_breaks": [
            {"reason": r.reason, "frames": [(f.filename, f.lineno, f.name) for f in r.user_stack]}
            for r in graph_break_reasons
        ],
    }


def build_strategy(spec: Any, world_size: int) -> Any:
    if world_size == 1 and not isinstance(spec, dict):
        from lightning_parallel.strategies import SingleDeviceReferenceStrategy

        return SingleDeviceReferenceStrategy()
    if isinstance(spec, dict):
        import lightning_parallel  # noqa: F401  (registers names; classes may live there)

        return load_object(spec["class"])(**spec.get("kwargs", {}))
    import lightning_parallel  # noqa: F401

    return spec


def before_teardown(trainer: Trainer, call: Any) -> list:
    """Call ``call(trainer)`` when fit ends, before the strategy gives the module back whole; the list
    receives its result."""
    found: list = []
    strategy = trainer.strategy
    teardown = strategy.teardown

    def first_call_then_teardown() -> None:
        if not found and trainer.state.fn == "fit":
            found.append(call(trainer))
        teardown()

    strategy.teardown = first_call_then_teardown
    return found


def forward_on_first_samples(model: Any, data: Any) -> torch.Tensor:
    """The module's output (no grad) on the first two training samples, as one process computes it."""
    from torch.utils.data import default_collate

    dataset = data.train_dataloader().dataset
    batch = default_collate([dataset[0], dataset[1]])
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    dtype = next(model.parameters()).dtype
    x = x.to(dtype) if x.is_floating_point() else x
    with torch.no_grad():
        return model(x).detach().clone()


def refusals(model: Any, data: Any) -> dict:
    """What ``state_dict()`` and a forward of a module left split raise: {call: (error type, message)}."""
    found = {}
    for name, call in (
        ("state_dict", model.state_dict),
        ("forward", lambda: forward_on_first_samples(model, data)),
    ):
        try:
            call()
            found[name] = None
        except Exception as error:  # the error is the result
            found[name] = (type(error).__name__, str(error))
    return found


def run_case(case: dict, world_size: int, out_dir: Path) -> dict:
    """Fit ``case`` with the global batch split over ``world_size`` processes; return what it produced."""
    seed_everything(case.get("seed", 0), workers=True)
    reset_peak_resident()
    rss_before = rss_bytes()
    deferred = "empty_init" in case  # the model is built under trainer.init_module(empty_init=...)
    if not deferred:
        model = load_object(case["model"])(**case.get("model_kwargs", {}))
    data_kwargs = dict(case.get("data_kwargs", {}))
    global_batch = data_kwargs.pop("global_batch_size", 8)
    dp_size = case.get("dp_size", world_size)  # processes that share one batch do not divide it
    data = load_object(case["data"])(batch_size=global_batch // dp_size, **data_kwargs)
    from lightning_parallel.quiet_trainer import QUIET_TRAINER

    recorder = LossRecorder()
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=world_size,
        callbacks=[recorder],
        **QUIET_TRAINER,
    )
    trainer_kwargs.update(case.get("trainer", {}))
    for cb in case.get(
        "callbacks", []
    ):  # {"class": "module:Class", "kwargs": {...}}; "dirpath" is made per case
        kwargs = dict(cb.get("kwargs", {}))
        if "dirpath" in kwargs:
            kwargs["dirpath"] = str(out_dir / kwargs["dirpath"])
        trainer_kwargs["callbacks"].append(load_object(cb["class"])(**kwargs))
    if any(c["class"].endswith(":ModelCheckpoint") for c in case.get("callbacks", [])):
        trainer_kwargs["enable_checkpointing"] = True
    if case.get(
        "fp16_cpu"
    ):  # Lightning turns 16-mixed into bf16 on CPU; this keeps fp16 and a real GradScaler
        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=case.get("fp16_init_scale", 2.0**16))
        trainer_kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    if case.get("csv_logger"):  # for callbacks that need a logger (LearningRateMonitor)
        from lightning.pytorch.loggers import CSVLogger

        trainer_kwargs["logger"] = CSVLogger(out_dir, name="csv")
    memory = SetupMemory(rss_before)
    trainer_kwargs["callbacks"].append(memory)
    trainer = Trainer(strategy=build_strategy(case.get("strategy", "auto"), world_size), **trainer_kwargs)
    if deferred:
        with trainer.init_module(empty_init=case["empty_init"]):
            model = load_object(case["model"])(**case.get("model_kwargs", {}))
    fit_kwargs = {"weights_only": case["weights_only"]} if "weights_only" in case else {}
    probe = load_object(case["probe"]) if case.get("probe") else None
    inside = getattr(probe, "before_teardown", False)  # looks at the split module, before it is whole again
    if inside:
        inside = before_teardown(trainer, probe)
    if case.get("save_checkpoint") == "split":  # the checkpoint of the split module, as fit ends
        before_teardown(trainer, lambda t: t.save_checkpoint(out_dir / "last.ckpt"))
    compiled = "compile" in case  # {"backend": "eager", ...}: torch.compile's keyword arguments
    records = compiled or case.get("record_dynamo", False)
    if records:
        reset_dynamo()
    with warnings.catch_warnings(record=records) as caught:  # what set-up says about a compiled model
        if records:
            warnings.simplefilter("always")
        try:
            trainer.fit(
                torch.compile(model, **case["compile"]) if compiled else model,
                datamodule=data,
                ckpt_path=case.get("ckpt_path"),
                **fit_kwargs,
            )
        except Exception as error:
            if case.get(
                "expect_error"
            ):  # the fit must fail: its error and what trained before it are the result
                return {"error": f"{type(error).__name__}: {error}", "losses": recorder.losses}
            if not case.get("may_refuse"):
                raise
            # every rank refused before training (an error on some ranks only would have hung): the result
            return {"refused": f"{type(error).__name__}: {error}", "global_step": trainer.global_step}
    if case.get("expect_error"):
        return {"error": None, "losses": recorder.losses}
    if case.get("validate_after_fit"):
        trainer.validate(model, datamodule=data, verbose=False)
    result = {
        "losses": recorder.losses,
        "state_dict": {}
        if case.get("no_state_dict") or case.get("split_after_fit")
        else {k: v.detach().clone() for k, v in model.state_dict().items()},
        "refused": refusals(model, data) if case.get("split_after_fit") else None,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "setup_memory": memory.figures(),
    }
    result["callback_state"] = {
        type(c).__name__: {
            "best_model_path": str(getattr(c, "best_model_path", "")),
            "stopped_epoch": getattr(c, "stopped_epoch", None),
        }
        for c in trainer.callbacks
        if type(c).__name__ in ("ModelCheckpoint", "EarlyStopping")
    }
    if records:
        result["dynamo"] = dynamo_record()
        result["compile_warnings"] = [
            str(w.message) for w in caught if "under torch.compile" in str(w.message)
        ]
    if probe is not None:  # "module:function(trainer) -> picklable", to look inside the strategy
        result["probe"] = inside[0] if inside else probe(trainer)
    if case.get("forward_after_fit") and trainer.global_rank == 0:
        result["forward"] = forward_on_first_samples(model, data)
    if case.get("save_checkpoint") is True:
        trainer.save_checkpoint(out_dir / "last.ckpt")
    return result


def threads_after_destroy() -> list[str]:
    """The names of this process's OS threads once the process group is destroyed and garbage is collected:
    whatever still holds a process group keeps its gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``)
    running into interpreter exit, where their teardown can abort the process."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    gc.collect()
    return [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    for case in spec["cases"]:
        out_dir = Path(spec["out"]) / case["name"]
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(run_case(case, world_size, out_dir), out_dir / f"rank{rank}.pt")
    if spec.get("threads_after_destroy"):
        (Path(spec["out"]) / f"threads_rank{rank}.json").write_text(json.dumps(threads_after_destroy()))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers in atexit handlers
