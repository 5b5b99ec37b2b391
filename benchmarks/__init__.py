"""Benchmarks of grpo_fast against its peers (installed as `grpo_fast.benchmarks`; `grpo-fast bench` and
`grpo-fast demo` run them).

- implementations: every method measured, behind one interface (naive, TRL 1.16, Liger, grpo_fast, floor).
- harness: shapes, timing, peak memory, GEMM passes, accuracy, and the table / JSON / plots (`grpo-fast bench`).
- demo: a two-row run of the harness, the full-logits loss against grpo_fast's (`grpo-fast demo`).
- gpu_check: the one-GPU script: correctness against float64 that fails on a wrong kernel, per-pass times at the
  headline shape, end to end against the floor and the peers, a SUMMARY printed last, within a time budget.
- long_context: peak memory and step time of the trainer's update per completion length, against the planner, on a
  tiny random model or a real checkpoint (SmolLM2-135M-Instruct with YaRN to 16k), with one long rollout per engine.
- real_shapes: the same on Qwen2.5-0.5B's shape for each memory option (fp32, bf16 with AdamW / 8-bit / bf16-state
  AdamW, LoRA), against the planner.
- fit_table: by the planner, the memory option that makes a 16k-token job of each preset fit each card.
- bench_engines: rollout-engine throughput (Hugging Face generate and vLLM).
- real_model: SmolLM2-135M-Instruct's rollout and update throughput (engines; one forward per group's prompt).
- profiling: GEMM FLOP counting, peak memory and the machine's name (the benchmarks' and the tests').
- trl_real_model: SmolLM2-135M-Instruct against TRL's GRPOTrainer: whole-step steps/hour of grpo_fast's trainer,
  and FastGRPOTrainer's time and peak RSS per completion length.

The pytest-benchmark microbenchmarks of the chunk passes are in tests/kernels/bench_kernel_passes.py.
"""
