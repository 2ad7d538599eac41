"""The plan table under expert parallelism (``--ep``, ``moe.expert_traffic``) on a tiny Mixtral: each
rank's experts and parameters equal what ``apply_expert_parallel`` leaves on that rank, the all-to-all bytes
follow the traced batch, and bad sizes get the strategy's own messages. The comparison with the bytes a
real ep=2 run hands to its all-to-alls is in tests/strategies/test_expert_parallel.py."""

from __future__ import annotations

import pytest

from lightning_parallel.cli.plan_table import main
from lightning_parallel.moe.expert_parallel import apply_expert_parallel, expert_parallel_problem
from lightning_parallel.strategies.parallel import ParallelStrategy
from lightning_parallel.tensor import resolve
from lightning_parallel.tensor.sample import forward_on
from lightning_parallel.tensor.table import expert_placement, plan_rows
from tests.helpers.tp_models import TokenData
from tests.helpers.zoo import ZooLM

MIXTRAL = ["tests.helpers.zoo:ZooLM", "--kwargs", '{"arch": "mixtral"}']
DATA = ["--data", "tests.helpers.tp_models:TokenData"]


def first_batch(batch_size: int = 8):
    data = TokenData(batch_size=batch_size)
    return next(iter(data.train_dataloader()))


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2), (1, 4)])
def test_params_per_rank_equal_what_each_rank_holds(tp, ep):
    module = ZooLM(arch="mixtral")
    resolved = resolve(module, "auto", tp, run=forward_on(module, first_batch()))
    resolved.experts = expert_placement(module, ep, None)
    rows = {r.name: r for r in plan_rows(module, resolved)}
    for rank in range(ep):
        placed = apply_expert_parallel(ZooLM(arch="mixtral"), None, ep, rank)
        assert len(placed) == 2
        for name, m in placed.items():
            assert rows[name].style == f"experts ep={ep}"
            assert rows[name].params_per_rank == sum(p.numel() for p in m.parameters())
            assert rows[name].local_shape.startswith(f"[{4 // ep}, ")
    if tp == 1:  # nothing tensor-parallel: the experts' rows and the rest, whole, without all-reduces
        assert {r.style for r in rows.values()} == {f"experts ep={ep}", "replicate"}


def test_all_to_all_bytes_follow_the_traced_batch():
    module = ZooLM(arch="mixtral")  # 2 layers, 4 experts top-2, hidden 16, float32
    for batch_size in (8, 4):
        traced = expert_placement(module, 2, forward_on(module, first_batch(batch_size)))
        tokens = batch_size * 8
        per_layer = 4 * 8 + 4 * tokens * 2 * 16 * 4  # the counts, then 4 exchanges of the top-2 copies
        assert traced.total_bytes(module) == 2 * per_layer
        assert [len(c) for c in traced.calls.values()] == [1, 1]


def test_cli_prints_experts_per_rank_and_the_all_to_all(capsys):
    assert main(MIXTRAL + DATA + ["--tp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "model.model.layers.0.mlp.experts       experts ep=2  [2, 96, 16]+[2, 16, 48]  4,608" in out
    assert "TOTAL                                  tp=2 ep=2" in out
    assert "2 of 4 experts per rank in each of 2 experts module(s) (ep rank 0: 0..1; ep rank 1: 2..3)" in out
    assert "64 tokens x top-2 x 16 hidden x 4 bytes per exchange" in out
    assert "total: 65,600 B per step (32,832 forward + 32,768 backward)" in out
    assert main(MIXTRAL + ["--tp", "2", "--ep", "2"]) == 0  # nothing to trace: no byte count made up
    out = capsys.readouterr().out
    assert "all-to-all per step: not traced" in out and "B per step" not in out


def test_cli_refuses_bad_expert_parallel_sizes_as_the_strategy_does(capsys):
    assert main(MIXTRAL + ["--ep", "3"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {expert_parallel_problem(ZooLM(arch='mixtral'), 3)}"
    values = {"expert_parallel_size": 2, "data_parallel_size": 3}
    (expected,) = [p for p in ParallelStrategy.expert_problems(values) if p]  # None: a check that passes
    with pytest.raises(SystemExit):
        main(MIXTRAL + ["--ep", "2", "--dp", "3"])
    assert expected in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not divide"):  # the strategy: the same words
        ParallelStrategy(**values)
    with pytest.raises(SystemExit):
        main(MIXTRAL + ["--ep", "2", "--sequence-parallel"])
    assert "not composed with sequence parallelism" in capsys.readouterr().err
