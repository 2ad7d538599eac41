"""``benchmarks/bench_compile.py``'s GPU variant, for the day a device is lent: it parses its arguments and
builds its model on CPU (on meta, no memory), at the size the issue asks (HF Llama ~220M, seq 1024, bf16)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.harness import REPO


def bench():
    spec = importlib.util.spec_from_file_location("bench_compile", REPO / "benchmarks" / "bench_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_variant_parses_and_builds_a_220m_llama_on_meta():
    b = bench()
    args = b.parse(["--gpu"])
    assert (args.seq, args.precision, args.backend) == (1024, "bf16-mixed", "inductor")
    assert args.names == list(b.GPU_STRATEGIES) and all(n == 1 for n, _ in b.GPU_STRATEGIES.values())
    with torch.device("meta"):
        module = b.llama_module(args.seq)
    count = sum(p.numel() for p in module.parameters())
    assert 200e6 < count < 240e6, count
    b.parse(["--gpu", "--worker", "--strategy", "zero1", "--compiled"])  # a worker's command line


def test_a_strategy_outside_the_mode_is_refused():
    b = bench()
    with pytest.raises(SystemExit):
        b.parse(["--gpu", "--strategies", "single,tp2xpp2"])
