"""Benchmarks of grpo_fast against its peers (installed as `grpo_fast.benchmarks`; `grpo-fast bench` runs them).

- implementations: every method measured, behind one interface (naive, TRL 1.16, Liger, grpo_fast, floor).
- harness: shapes, timing, peak memory, GEMM passes, accuracy, and the table / JSON / plots.
- gpu_check: the one-GPU script: bf16 correctness, then the GPU sweep, within a time budget.
- bench_kernel_passes: pytest-benchmark microbenchmarks of the chunk passes.
"""
