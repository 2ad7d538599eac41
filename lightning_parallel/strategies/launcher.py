"""A subprocess launcher that is safe under Hydra multirun (``-m``) and across jobs in one process.

Lightning's ``_SubprocessScriptLauncher`` re-runs ``sys.argv`` in each extra local rank. Under a Hydra
sweep (Lightning issues #11300, #15689; Hydra issue #2070) that child re-runs the whole sweep; the launching
process keeps ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` in ``os.environ`` so the next job starts
no children; its process group is never destroyed; and a failing child SIGKILLs the launching
process, i.e. the whole sweep. This launcher differs in these ways:

- under Hydra the child command is this job's own overrides (``HydraConfig.get().overrides.task``)
  plus ``hydra.run.dir=<this job's folder> hydra.mode=RUN``: one job, not the sweep;
- each child's output goes to ``<job folder>/train_rank<r>.out`` and its Hydra log to
  ``train_rank<r>.log``, next to rank 0's;
- ``finish_job()`` (called by ``lp-train`` when a job ends, and lazily when a launcher of a *later* job
  starts, and at exit) waits for the children, kills any left, destroys the process group and
  restores the environment variables the launch set;
- a failing child is reported (with the tail of its output) and its peers are stopped, but the
  launching process is never killed: its collectives fail, the job fails, the sweep goes on;
- children mark (in a temporary folder) that they are about to join the process group, and the
  launching process waits for that, interruptibly: a child that dies before the rendezvous (import
  error, failing ``__init__``) fails the job at once instead of blocking rank 0 in the rendezvous
  until the process-group timeout (30 minutes); one that dies after that mark, before the process group
  is formed (a failing device set-up), makes the observer close the store this process hosts, which
  ends rank 0's rendezvous at once: the run raises ``RankFailedError`` naming the rank and its exit code.
  Rank 0 connects to that store before it starts the children (``launching_store``, given to
  ``init_process_group`` by the strategy), so this holds also when the child dies before rank 0 reaches
  the rendezvous: a client that first connects after the close retries until the process-group timeout;
- before the run looks for ``ckpt_path="last"``, the strategy's ``recover_interrupted_saves`` puts back a
  checkpoint that a killed sharded save left under a hidden name (``checkpointing/interrupted_saves.py``);
- on one node with children to start, unless ``MASTER_PORT`` is set, the launching process binds the
  rendezvous store *before* it starts the children (``distributed/rendezvous.py``), instead of picking
  a free port and leaving it unbound while the children import: in CI another process took such a
  port and rank 0 failed with ``EADDRINUSE``;
- outside Hydra, a launch whose run raises in the launching process ends at once (``_end_failed_launch``);
- between runs the launching process holds what Lightning's ``ddp`` holds, no more: the variables that
  send a later ``Trainer`` of the same script to the same children (``LOCAL_RANK``, ``MASTER_PORT``, ...),
  the process group, and a daemon thread that watches the children until they exit (``stop()`` joins
  it). ``TORCHELASTIC_USE_AGENT_STORE``, which makes this process a client of its own hosted store, and
  ``TORCHELASTIC_RESTART_COUNT`` beside it are set only while a run is in progress; a launch that starts
  children again (its variables were removed, as a test suite does between tests) first ends the previous
  one (``finish_job``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_parallel.compat import RESTART_COUNT_ENV, agent_store_env
from lightning_parallel.distributed.rendezvous import AGENT_STORE_ENV, HostedStore

__all__ = [
    "HydraSafeSubprocessLauncher",
    "finish_job",
    "launching_store",
    "failure_exit_fn",
    "install",
    "child_command",
    "RankFailedError",
    "is_launched_rank",
    "ENTRY_ENV",
    "READY_ENV",
    "LAUNCH_ENV_VARS",
]

log = logging.getLogger(__name__)

# Set by ``lp-train`` to the JSON list that starts the same Hydra app (``python -m ...`` plus config
# flags): under the joblib launcher a job runs in a worker whose ``sys.argv`` is not the app's.
ENTRY_ENV = "LP_HYDRA_ENTRY"
# What a launch writes into os.environ; ``finish_job`` restores each to its value before the launch.
LAUNCH_ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "OMP_NUM_THREADS",
    AGENT_STORE_ENV,
    RESTART_COUNT_ENV,
)
# A folder where each child marks (``<local rank>``) that it is about to join the process group.
READY_ENV = "LP_LAUNCH_READY_DIR"
# How long the launching process waits for its children to reach the rendezvous (importing torch
# and the user's code); a child that hangs before it then fails the job instead of stalling a sweep.
READY_TIMEOUT_S = 600.0
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


class RankFailedError(RuntimeError):
    """A rank started by the launcher exited with an error."""


class _JobState:
    """What one job's launch changed in this process, so that it can be undone."""

    def __init__(
        self, job_key: Optional[str], env_before: dict[str, Optional[str]], threads_before: int
    ) -> None:
        self.job_key = job_key
        self.env_before = env_before
        self.threads_before = threads_before
        self.procs: list[subprocess.Popen] = []
        self.ranks: list[int] = []  # the global rank of each process in ``procs``
        self.logs: list[Path] = []
        self.failed: list[str] = []
        self.observer: Optional[_Observer] = None
        self.ready_dir: Optional[str] = None
        self.store: Optional[HostedStore] = None
        # this process's own connection to ``store``, made before the children start (see launching_store)
        self.connection: Optional[torch.distributed.Store] = None


_ACTIVE: Optional[_JobState] = None
_LOCK = threading.Lock()


def _hydra_job() -> Optional[Any]:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:  # pragma: no cover - hydra is a dependency, but keep the launcher usable without it
        return None
    return HydraConfig.get() if HydraConfig.initialized() else None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _failure_message(rank: int, proc: subprocess.Popen, log_path: Path) -> str:
    """First line: which rank, its exit code and its last output line (usually the exception)."""
    tail = _tail(log_path)
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "no output")
    return (
        f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}: {last}\n"
        f"  last lines of {log_path}:\n{tail}"
    )


class _Observer(threading.Thread):
    """Watches the children; on a failure it reports it and stops the other children (never this process)."""

    def __init__(self, state: _JobState) -> None:
        super().__init__(daemon=True, name="lp-child-observer")
        self.state = state
        self._halt = threading.Event()

    def stop(self) -> None:
        """Stop watching and join (the children are left as they are)."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5.0)

    def run(self) -> None:
        while not self._halt.wait(0.5):
            for rank, proc, log_path in zip(self.state.ranks, self.state.procs, self.state.logs):
                code = proc.poll()
                if code:
                    message = _failure_message(rank, proc, log_path)
                    self.state.failed.append(message)
                    log.error(message)
                    _kill(self.state.procs)
                    _abort_rendezvous(self.state)
                    return
            if all(p.poll() == 0 for p in self.state.procs):
                return


def _abort_rendezvous(state: _JobState) -> None:
    """A child died before the process group was formed: this process, waiting for it in the rendezvous
    (in C++, for the process-group timeout), is freed by closing the store it hosts; its
    ``init_process_group`` then raises at once. A store that this process does not host (``MASTER_PORT``
    given, several nodes) cannot be closed from here: there the process-group timeout applies."""
    if state.store is not None and not torch.distributed.is_initialized():
        log.error("a rank exited before the process group was formed: ending this job's rendezvous")
        state.store.close()


def _connect(store: HostedStore) -> torch.distributed.Store:
    """This process's client of the store it hosts, made as torch's ``env://`` rendezvous makes it for a
    rank of a hosted ("agent") store. Connected before any child starts, so that ``_abort_rendezvous``
    always fails it at once: a client that first connects after the store closed retries until the
    process-group timeout."""
    with _env(agent_store_env(AGENT_STORE_ENV)):
        connection, _, _ = next(torch.distributed.rendezvous("env://", rank=0, world_size=store.world_size))
    return connection


def launching_store() -> Optional[torch.distributed.Store]:
    """For the first process group of a launch, in the process that launched it and hosts its store: the
    ``store`` to give ``init_process_group``, this process's connection to that store, made before the
    children started (once; None elsewhere, and for a group made again later in the run, which connects
    through ``env://``). Under the prefix the ``env://`` path adds (``default_pg``), so that this rank
    meets the children's keys."""
    with _LOCK:
        state = _ACTIVE
        if state is None or state.connection is None:
            return None
        connection, state.connection = state.connection, None
    return torch.distributed.PrefixStore("default_pg", connection)


def _kill(procs: Sequence[subprocess.Popen], grace: float = 0.0) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        if proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                try:
                    proc.wait(remaining)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            proc.send_signal(signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            log.error("rank process %d did not exit after SIGKILL", proc.pid)


def is_launched_rank() -> bool:
    """Whether this process is a rank > 0 that this launcher started (its launching process set ``READY_ENV``)."""
    return bool(os.environ.get(READY_ENV))


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def finish_job(wait_timeout: float = 60.0, job_failed: bool = False) -> None:
    """End the current job's launch in this (launching) process: idempotent, safe to call when none is active.

    Waits up to ``wait_timeout`` s for the children to exit, kills any left, destroys the default process
    group and restores the environment variables and thread count the launch changed. With
    ``job_failed`` (this process failed) the process group goes first: the children, blocked in a
    collective with this process, then fail at once instead of waiting for the timeout. Raises
    ``RankFailedError`` if a child failed, after cleaning up.
    """
    global _ACTIVE
    with _LOCK:
        state, _ACTIVE = _ACTIVE, None
    if state is None:
        return
    if state.observer is not None:
        state.observer.stop()
    if job_failed:
        _destroy_process_group()
    _kill(state.procs, grace=5.0 if job_failed else wait_timeout)
    _destroy_process_group()
    state.connection = None
    if state.store is not None:
        state.store.close()
    for key, value in state.env_before.items():
        _restore(key, value)
    torch.set_num_threads(state.threads_before)
    if state.ready_dir is not None:
        shutil.rmtree(state.ready_dir, ignore_errors=True)
    failed = list(state.failed)
    for rank, proc, log_path in zip(state.ranks, state.procs, state.logs):
        if proc.returncode not in (0, None) and not any(f.startswith(f"rank {rank} ") for f in failed):
            failed.append(_failure_message(rank, proc, log_path))
    if failed:
        raise RankFailedError("\n".join(failed))


def _restore(key: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block; afterwards the variables are as they were."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            _restore(key, value)


@contextmanager
def _client_of_hosted_store(state: Optional[_JobState]) -> Iterator[None]:
    """While a run is in progress in the process that hosts its job's store, a (re)made process group
    joins that store as a client (torch's ``TORCHELASTIC_USE_AGENT_STORE``, and the restart count that torch
    <= 2.5 reads with it); afterwards the variables are as they were."""
    if state is None or state.store is None:
        yield
        return
    with _env(agent_store_env(AGENT_STORE_ENV)):
        yield


def _end_failed_launch() -> None:
    """The launching process's run raised, outside Hydra (a script, a notebook, a test): end the launch now.

    Otherwise ``LOCAL_RANK`` and ``MASTER_PORT`` stay in ``os.environ`` and the next ``Trainer.fit`` in
    this process believes its processes were created externally: it starts no children and waits for
    them forever. (Under Hydra the job's end does this: ``lp-train``, or the next job's launch.) A
    child's failure is logged; the exception the user sees stays this process's own.
    """
    try:
        finish_job(job_failed=True)
    except RankFailedError as err:
        log.error("%s", err)


def failure_exit_fn() -> Callable[[int], None]:
    """What the failure watchdog (``distributed/watchdog.py``) does when a peer failed or hung.

    Normally it ends the process (``os._exit``). The process that launched this job's ranks may host
    more than this job (a Hydra sweep runs its jobs in-process): ending it would end the sweep. There
    it stops the job's other ranks instead; this rank's collectives then fail, and the job fails.
    """
    state = _ACTIVE
    if state is None:
        return os._exit

    def stop_other_ranks(code: int) -> None:
        log.error(
            "a peer rank failed or hung: stopping this job's other ranks (this process stays, the job fails)"
        )
        _kill(state.procs)

    return stop_other_ranks


atexit.register(lambda: finish_job(wait_timeout=10.0) if _ACTIVE is not None else None)


def child_command(local_rank: int, global_rank: int) -> tuple[list[str], Optional[str]]:
    """The command (and working directory) that starts one more rank of the current run.

    Under Hydra: the same app, this job's overrides only, in RUN mode, writing into this job's folder.
    Without Hydra: Lightning's own choice (the script and its arguments).
    """
    hydra_cfg = _hydra_job()
    if hydra_cfg is None:
        return list(_basic_subprocess_cmd()), None
    from hydra.utils import get_original_cwd, to_absolute_path

    entry = os.environ.get(ENTRY_ENV)
    if entry:
        command = list(json.loads(entry))
    else:
        import __main__

        spec = getattr(__main__, "__spec__", None)
        command = (
            [sys.executable, "-m", spec.name]
            if spec is not None
            else [sys.executable, to_absolute_path(sys.argv[0])]
        )
        argv = sys.argv[1:]
        for i, arg in enumerate(argv):
            if arg.split("=", 1)[0] in _CONFIG_FLAGS:
                command.append(arg)
                if "=" not in arg and i + 1 < len(argv):
                    command.append(argv[i + 1])
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    run_dir = hydra_cfg.runtime.output_dir
    command += overrides + [
        f"hydra.run.dir={json.dumps(str(run_dir))}",
        "hydra.mode=RUN",
        "hydra.output_subdir=null",
        f"hydra.job.name={hydra_cfg.job.name}_rank{global_rank}",
    ]
    return command, get_original_cwd()


class HydraSafeSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with a per-job life cycle; see the module docstring."""

    def launch(
        self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any
    ) -> Any:
        job = _hydra_job()
        job_key = str(job.runtime.output_dir) if job is not None else None
        env = self.cluster_environment
        if _ACTIVE is not None and (_ACTIVE.job_key != job_key or not env.creates_processes_externally):
            # a previous job in this process was never finished (a user's own Hydra app, or a test suite
            # that removed the launch's variables): finish it now
            log.info("finishing the launch of the previous job (%s) before this one", _ACTIVE.job_key)
            finish_job()
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        # read after finish_job, which removes the previous launch's variables
        if not env.creates_processes_externally:
            self._start_job_children()
            self._wait_until_children_ready()
        elif is_launched_rank():
            # a child of ours, about to join the process group: tell the launching process
            Path(os.environ[READY_ENV], os.environ.get("LOCAL_RANK", "0")).touch()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        state = _ACTIVE
        try:
            recover = getattr(getattr(trainer, "strategy", None), "recover_interrupted_saves", None)
            if recover is not None:  # before Lightning looks for ckpt_path="last"
                recover(trainer)
            with _client_of_hosted_store(state):
                return function(*args, **kwargs)
        except BaseException as err:
            # the rendezvous ended by _abort_rendezvous: the cause is the child that died, not the store
            lost = state is not None and state.failed and not torch.distributed.is_initialized()
            failed = list(state.failed) if lost else []
            if job is None and _ACTIVE is not None:
                _end_failed_launch()
            if failed and not isinstance(err, RankFailedError):
                raise RankFailedError("\n".join(failed)) from err
            raise

    def _wait_until_children_ready(self) -> None:
        """Wait (interruptibly) until every child is about to join the process group.

        The rendezvous itself blocks in C++ until all ranks arrive or the process-group timeout (30
        minutes by default) passes; a child that dies before it (an import error, a failing
        ``__init__``) would leave this process stuck there. Failing here instead keeps a sweep going.
        """
        state = _ACTIVE
        if state is None or state.ready_dir is None:
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            waiting = [
                (rank, proc, log_path)
                for local_rank, rank, proc, log_path in zip(
                    range(1, len(state.procs) + 1), state.ranks, state.procs, state.logs
                )
                if not Path(state.ready_dir, str(local_rank)).exists()
            ]
            if not waiting:
                return
            for rank, proc, log_path in waiting:
                if proc.poll() is not None:
                    raise RankFailedError(
                        _failure_message(rank, proc, log_path)
                        + "\n(it exited before joining the process group)"
                    )
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"rank(s) {[w[0] for w in waiting]} did not reach the process group within "
                    f"{READY_TIMEOUT_S:.0f} s of their start; their output: {[str(w[2]) for w in waiting]}"
                )
            time.sleep(0.1)

    def _start_job_children(self) -> None:
        global _ACTIVE
        self._check_can_spawn_children()
        job = _hydra_job()
        state = _JobState(
            job_key=str(job.runtime.output_dir) if job is not None else None,
            env_before={key: os.environ.get(key) for key in LAUNCH_ENV_VARS},
            threads_before=torch.get_num_threads(),
        )
        with _LOCK:
            _ACTIVE = state
        env = self.cluster_environment
        if self.num_nodes == 1 and self.num_processes > 1 and "MASTER_PORT" not in os.environ:
            state.store = HostedStore(self.num_processes, host=env.main_address)
            os.environ.update(state.store.env())
            if hasattr(env, "_main_port"):  # LightningEnvironment keeps the first port it read
                env._main_port = state.store.port
            state.connection = _connect(state.store)
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        out_dir = Path(job.runtime.output_dir) if job is not None else None
        state.ready_dir = tempfile.mkdtemp(prefix="lp-launch-")
        for local_rank in range(1, self.num_processes):
            child_env = os.environ.copy()
            child_env["LOCAL_RANK"] = str(local_rank)
            child_env[READY_ENV] = state.ready_dir
            if os.environ.get("PL_GLOBAL_SEED") is None:
                child_env.pop("PL_GLOBAL_SEED", None)
            global_rank = env.node_rank() * self.num_processes + local_rank
            command, cwd = child_command(local_rank, global_rank)
            if out_dir is not None:
                log_path = out_dir / f"{job.job.name}_rank{global_rank}.out"
                with open(log_path, "ab") as out:
                    proc = subprocess.Popen(
                        command, env=child_env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
                    )
            else:
                log_path = Path(os.devnull)
                proc = subprocess.Popen(command, env=child_env, cwd=cwd)
            state.procs.append(proc)
            state.ranks.append(global_rank)
            state.logs.append(log_path)
        if state.store is not None:  # set again only while a run of this job is in progress
            for key in agent_store_env(AGENT_STORE_ENV):
                _restore(key, state.env_before[key])
        self.procs = state.procs
        state.observer = _Observer(state)
        state.observer.start()


def install(strategy: Any) -> bool:
    """Give a Lightning ``DDPStrategy`` (ours or the built-in one) this launcher if it would use popen.

    Returns whether it was installed. Call after the ``Trainer`` is built (it configures the launcher).
    """
    launcher = getattr(strategy, "_launcher", None)
    if type(launcher) is _SubprocessScriptLauncher:
        strategy._launcher = HydraSafeSubprocessLauncher(
            launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
        )
        return True
    return isinstance(launcher, HydraSafeSubprocessLauncher)
