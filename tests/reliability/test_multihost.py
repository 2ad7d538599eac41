"""A real 2-host run: two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2) play two
machines; ``torch.distributed.run --nnodes=2 --nproc_per_node=1`` runs in each, with static rendezvous
over TCP between the two addresses, and ``Trainer(num_nodes=2, devices=1)`` trains. The parameters must
equal the single-host 2-process run's (float64, to 1e-10).

Needs root and ``ip netns`` (iproute2); skips with the reason otherwise. The namespaces (and with them
the veth pair) are deleted afterwards, also on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from lightning_parallel import STRATEGY_NAMES
from lightning_parallel.processes import run_processes
from tests.helpers.harness import REPO, assert_params_close, run_distributed

ADDRS = ("10.77.0.1", "10.77.0.2")
# Strategies to run across hosts, with their case overrides. A pipeline strategy joins by adding its
# name here (one stage per host), e.g. "lp_pipeline_1f1b": {"model": ..., "strategy": ...}.
MULTIHOST = {"lp_ddp": {}, "lp_pipeline_1f1b": {"dp_size": 1}}  # pipeline: one stage per host
CASE = {
    "model": "tests.helpers.models:MLP",
    "data": "tests.helpers.models:RegressionData",
    "data_kwargs": {"global_batch_size": 16, "n": 64},
    "model_kwargs": {"momentum": 0.9},
    "trainer": {"precision": "64-true", "max_steps": 6},
}


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"lp_probe_{os.getpid()}"
    r = _ip("netns", "add", probe)
    if r.returncode != 0:
        return f"`ip netns add` is forbidden here: {r.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@contextmanager
def two_hosts() -> Iterator[tuple[list[str], list[str]]]:
    """Yields ([namespace A, B], [veth in A, veth in B]); removes both namespaces on exit."""
    tag = os.getpid() % 100000
    names, veths = [f"lp_host{tag}_a", f"lp_host{tag}_b"], [f"lpv{tag}a", f"lpv{tag}b"]
    try:
        for ns in names:
            _check(_ip("netns", "add", ns))
        _check(_ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1]))
        for ns, veth, addr in zip(names, veths, ADDRS):
            _check(_ip("link", "set", veth, "netns", ns))
            _check(_ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth))
            _check(_ip("-n", ns, "link", "set", veth, "up"))
            _check(_ip("-n", ns, "link", "set", "lo", "up"))
        yield names, veths
    finally:
        for ns in names:
            _ip("netns", "del", ns)  # takes the veth end inside it, and so the pair, with it
        _ip("link", "del", veths[0])  # in case it never moved into a namespace


def _check(r: subprocess.CompletedProcess) -> None:
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(r.args)} failed: {r.stderr.strip()}")


def run_two_hosts(cases: list[dict], out: Path, timeout: float = 200.0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "out": str(out)}))
    with two_hosts() as (names, veths):
        commands, envs = [], []
        for node, (ns, veth) in enumerate(zip(names, veths)):
            envs.append(
                dict(
                    os.environ,
                    GLOO_SOCKET_IFNAME=veth,
                    OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                )
            )
            commands.append(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    "--nproc_per_node=1",
                    f"--node_rank={node}",
                    f"--master_addr={ADDRS[0]}",
                    "--master_port=29577",
                    "-m",
                    "tests.helpers.worker",
                    str(spec),
                ]
            )
        # the other node gets 3 s to notice a failure before it is stopped
        run_processes(
            commands,
            envs,
            timeout,
            out,
            grace=3.0,
            log_names=[str(out / f"node{i}.log") for i in range(2)],
            what="node",
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"no 2-host test: {reason}")
    tmp = tmp_path_factory.mktemp("multihost")
    names = [n for n in MULTIHOST if n in STRATEGY_NAMES]
    single = [{**CASE, "name": n, "strategy": n, **MULTIHOST[n]} for n in names]
    multi = [{**c, "trainer": {**c["trainer"], "num_nodes": 2, "devices": 1}} for c in single]
    run_two_hosts(multi, tmp / "hosts")
    local = run_distributed(single, world_size=2, tmp_path=tmp / "local")
    hosts = {
        c["name"]: [
            torch.load(tmp / "hosts" / c["name"] / f"rank{r}.pt", weights_only=False) for r in range(2)
        ]
        for c in multi
    }
    return hosts, local


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [n for n in MULTIHOST if n in STRATEGY_NAMES])
def test_two_hosts_equal_one_host(results, strategy):
    hosts, local = results
    for rank in range(2):
        assert_params_close(
            hosts[strategy][rank]["state_dict"], local[strategy][rank]["state_dict"], atol=1e-10
        )
        assert len(hosts[strategy][rank]["losses"]) == CASE["trainer"]["max_steps"]
    assert (
        max(abs(a - b) for a, b in zip(hosts[strategy][0]["losses"], local[strategy][0]["losses"])) <= 1e-10
    )
    losses = hosts[strategy][0]["losses"]
    assert abs(losses[-1] - losses[0]) > 1e-4, "training must move the model, or equality proves nothing"
