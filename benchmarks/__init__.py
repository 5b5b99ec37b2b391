"""Benchmarks of grpo_fast against its peers (installed as `grpo_fast.benchmarks`; `grpo-fast bench` runs them).

- implementations: every method measured, behind one interface (naive, TRL 1.16, Liger, grpo_fast, floor).
- harness: shapes, timing, peak memory, GEMM passes, accuracy, and the table / JSON / plots.
- gpu_check: the one-GPU script: correctness against float64 that fails on a wrong kernel, per-pass times at the
  headline shape, end to end against the floor and the peers, a SUMMARY printed last, within a time budget.
- bench_kernel_passes: pytest-benchmark microbenchmarks of the chunk passes.
- bench_engines, long_context: rollout-engine throughput; peak memory and step time per completion length.
"""
