"""Mini-batch updates per rollout (optimization.steps_per_generation): a step's rollouts cut into mini-batches of
whole groups, one optimizer step each, num_iterations passes, old log-probs taken once before the first; the
schedule moves at every optimizer step. Checked against the same steps redone by hand with the public loss, in
float64: each row's own forward, old log-probs from grpo_fast.token_logprobs, grpo_fast.grpo_loss over each
mini-batch (its own normalizer), clipping and AdamW."""

import pytest
import torch

pytest.importorskip("transformers")

import grpo_fast as gf  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from grpo_fast.train.update.optimizer import lr_factor  # noqa: E402
from grpo_fast.train.update.step import Policy, mini_batches, policy_updates, update_batch  # noqa: E402
from grpo_fast.variants import LossConfig  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

GROUP = 2
LR = 0.05                       # large: after the first optimizer step the ratio moves past the clip range


def model():
    return tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=0).double()


def rollout(groups: int = 4, seed: int = 3):
    """`groups` groups of GROUP ragged rows, a prompt per group."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 6, (groups,), generator=generator)]
    rows = [prompt for prompt in prompts for _ in range(GROUP)]
    completions = [torch.randint(1, 64, (int(n),), generator=generator).tolist()
                   for n in torch.randint(1, 8, (groups * GROUP,), generator=generator)]
    return pack(rows, completions, [False] * len(rows), pad_token_id=0)


def config_of(**keys):
    return flat_config(**{**dict(group_size=GROUP, max_completion_length=8, learning_rate=LR, warmup_steps=1,
                                 lr_schedule="constant", max_grad_norm=1.0), **keys})


def trainer_weights(config, generation, advantages, trained=None, lr=LR) -> tuple:
    """(weights after policy_updates, its metrics, the learning rate it reported) on a fresh model, with AdamW in
    float64 and the run's schedule (max_steps 10)."""
    policy = Policy.of(model())
    optimizer = torch.optim.AdamW(policy.trunk.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config.optimization, 10))
    batch = update_batch(generation, advantages, policy, None, config.scoring, config.correction,
                         config.optimization, config.batching, config.rollout.temperature, trained=trained)
    updates, lr = policy_updates(policy, optimizer, scheduler, batch, config.loss.at_length(8), config.batching,
                                 config.optimization, config.rollout.temperature, GROUP)
    return dict(policy.model.named_parameters()), updates, lr


def row_hidden(net, prompt: list, completion: list) -> torch.Tensor:
    """(len(completion), H): the final hidden states that predict each completion token, from the row's own
    forward."""
    ids = torch.tensor([prompt + completion])
    hidden = net.model(input_ids=ids).last_hidden_state[0]
    return hidden[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def by_hand(config, generation, advantages, trained=None) -> dict:
    """The same optimizer steps, written out: rows from the Generation's tensors, one forward per row."""
    net = model()
    weight = net.get_output_embeddings().weight
    rows = []
    for index in range(generation.input_ids.shape[0]):
        mask = generation.attention_mask[index]
        prompt = generation.input_ids[index, :generation.prompt_length][mask[:generation.prompt_length]].tolist()
        completion = generation.completion_ids[index][generation.completion_mask[index]].tolist()
        rows.append((prompt, completion))
    width = generation.completion_ids.shape[1]

    def padded_hidden(indices):
        states = torch.zeros(len(indices), width, net.config.hidden_size, dtype=torch.float64)
        for slot, index in enumerate(indices):
            hidden = row_hidden(net, *rows[index])
            states[slot, :hidden.shape[0]] = hidden
        return states

    everything = list(range(len(rows)))
    mask = generation.completion_mask.clone()
    if trained is not None:
        mask &= trained[:, None]
    with torch.no_grad():                                   # old log-probs once, before the first update, in fp32
        old = gf.token_logprobs(padded_hidden(everything), weight, generation.completion_ids).float() * mask
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    loss_config = LossConfig(**{name: getattr(config.loss, name) for name in LossConfig.__dataclass_fields__
                                if name != "max_completion_length"}, max_completion_length=8)
    per_step = config.optimization.steps_per_generation
    groups = len(rows) // GROUP
    update = 0
    for _ in range(config.optimization.num_iterations):
        for first in range(per_step):               # mini-batch k: groups k, k + per_step, ...
            part = [group * GROUP + row for group in range(first, groups, per_step) for row in range(GROUP)]
            part_mask = mask[part]
            if trained is not None and not bool(trained[part].any()):
                update += 1                  # no row to train on: no step, the schedule moves on
                continue
            for group in optimizer.param_groups:           # warm-up over one training step of `per_step` updates
                group["lr"] = LR * min(1.0, (update + 1) / (per_step * config.optimization.num_iterations + 1))
            rows_trained = int(trained[part].sum()) if trained is not None else len(part)
            # one update a step is on-policy: no old log-probs (the ratio is exactly 1)
            old_part = old[part] if config.optimization.updates_per_step > 1 else None
            loss, _ = gf.grpo_loss(padded_hidden(part), weight, generation.completion_ids[part], advantages[part],
                                   part_mask, old_logps=old_part, config=loss_config)
            if loss_config.reduction == "sequence_mean":    # the mean over the mini-batch's trained rows
                loss = loss * len(part) / rows_trained
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
    return dict(net.named_parameters())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("steps_per_generation,num_iterations", [(2, 1), (4, 1), (2, 2)])
def test_mini_batch_updates_equal_the_same_steps_by_hand(loss_type, steps_per_generation, num_iterations):
    config = config_of(loss_type=loss_type, steps_per_generation=steps_per_generation,
                       num_iterations=num_iterations, prompts_per_step=4)
    generation = rollout()
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights, updates, lr = trainer_weights(config, generation, advantages)
    expected = by_hand(config, generation, advantages)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-12, msg=name)
    per_step = steps_per_generation * num_iterations
    assert len(updates) == per_step and lr == pytest.approx(LR / (per_step + 1))
    # the first update is on-policy (the ratio is 1 up to the fp32 old log-probs); later ones clip
    assert updates[0]["clip_ratio/region_mean"] == 0.0
    assert max(update["clip_ratio/region_mean"] for update in updates[1:]) > 0


def test_clip_higher_acts_once_the_ratio_moves():
    """With one update a step the ratio is exactly 1 and epsilon_high cannot matter; with two mini-batches and two
    passes the ratio moves (the second pass sees tokens its first update made likelier) and clip-higher changes the
    weights."""
    generation = rollout()
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def weights(epsilon_high, per_step, passes):
        config = config_of(epsilon_high=epsilon_high, steps_per_generation=per_step, num_iterations=passes,
                           prompts_per_step=4)
        weights, updates, _ = trainer_weights(config, generation, advantages)
        if passes == 2 and epsilon_high == 0.2:
            assert updates[2]["clip_ratio/high_mean"] > 0
        return weights

    one = [weights(high, 1, 1) for high in (0.2, 0.28)]
    two = [weights(high, 2, 2) for high in (0.2, 0.28)]
    assert all(torch.equal(one[0][name], one[1][name]) for name in one[0])
    assert any(not torch.allclose(two[0][name], two[1][name]) for name in two[0])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_short_step_trains_on_its_informative_groups_as_a_step_of_those_alone(loss_type):
    """Dynamic sampling's short step: the filler groups (trained False) carry no loss and count in no normalizer,
    so the informative rows' update equals that of a step made of them alone; a mini-batch of fillers only takes
    no optimizer step."""
    generation = rollout()
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    trained = torch.tensor([True] * 6 + [False] * 2)            # 3 informative groups, 1 filler
    config = config_of(loss_type=loss_type, prompts_per_step=4)
    weights, updates, _ = trainer_weights(config, generation, advantages, trained)
    expected = by_hand(config, generation, advantages, trained)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-12, msg=name)
    alone = pack(*zip(*[(p, c, False) for p, c in zip(
        [generation.input_ids[i][generation.attention_mask[i, :generation.prompt_length].nonzero()[:, 0]].tolist()
         for i in range(6)],
        [generation.completion_ids[i][generation.completion_mask[i]].tolist() for i in range(6)])]), pad_token_id=0)
    three = config_of(loss_type=loss_type, prompts_per_step=3)
    alone_weights = trainer_weights(three, alone, advantages[:6])[0]
    for name, value in alone_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-12, msg=name)
    # four mini-batches: the last is the filler group alone (group 3), and takes no step
    four = config_of(loss_type=loss_type, steps_per_generation=4, prompts_per_step=4)
    weights, updates, _ = trainer_weights(four, generation, advantages, trained)
    assert len(updates) == 3
    for name, value in by_hand(four, generation, advantages, trained).items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_mini_batches_hold_whole_groups_and_every_row_once():
    policy = Policy.of(model())
    config = config_of(steps_per_generation=2, prompts_per_step=4)
    generation = rollout()
    batch = update_batch(generation, torch.arange(8.0, dtype=torch.float64), policy, None, config.scoring,
                         config.correction, config.optimization, config.batching, 1.0)
    parts = mini_batches(batch, 2, GROUP)
    # groups 0 and 2, then 1 and 3: the mini-batches of two ranks holding groups 0-1 and 2-3 (strided alike)
    assert [part.advantages.tolist() for part in parts] == [[0.0, 1, 4, 5], [2.0, 3, 6, 7]]
    assert torch.equal(torch.cat([part.old_logps for part in parts])[[0, 1, 4, 5, 2, 3, 6, 7]], batch.old_logps)
    with pytest.raises(ValueError, match=r"steps_per_generation \(3\) must divide the step's 4 groups"):
        mini_batches(batch, 3, GROUP)
    with pytest.raises(ValueError, match=r"steps_per_generation \(3\) cuts each process's 4 groups .* make "
                                         r"prompts_per_step a multiple of 3"):
        config_of(steps_per_generation=3, prompts_per_step=4).check_world(1)


def test_the_schedule_counts_optimizer_steps():
    """Warm-up over warmup_steps training steps, the rate moving at each of their optimizer steps; the decay ends
    at max_steps whatever the updates per step."""
    one = config_of(warmup_steps=2, lr_schedule="linear").optimization
    four = config_of(warmup_steps=2, lr_schedule="linear", steps_per_generation=4, prompts_per_step=4).optimization
    assert [lr_factor(s, one, 10) for s in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert [lr_factor(s, four, 10) for s in range(9)] == [(s + 1) / 9 for s in range(8)] + [1.0]
    assert lr_factor(39, four, 10) == pytest.approx(1 / 32) and lr_factor(40, four, 10) == 0.0
    assert lr_factor(9, one, 10) == pytest.approx(1 / 8)


def test_a_copy_of_the_batch_keeps_the_kept_sets_of_its_rows():
    """Top-k sampling: a mini-batch's kept sets are its rows' (KeptSet cut by positions)."""
    from grpo_fast.kept import KeptSet

    generation = rollout()
    columns = generation.completion_ids.shape[1]
    sizes = torch.arange(8 * columns) % 3 + 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    ids = torch.arange(int(offsets[-1])) % 64
    config = config_of(steps_per_generation=2, prompts_per_step=4)
    batch = update_batch(generation, torch.zeros(8, dtype=torch.float64), Policy.of(model()), None, config.scoring,
                         config.correction, config.optimization, config.batching, 1.0)
    batch.kept = KeptSet.of(ids, offsets)
    _, second = mini_batches(batch, 2, GROUP)                 # rows 2, 3, 6, 7
    spans = [(int(offsets[row * columns]), int(offsets[(row + 1) * columns])) for row in (2, 3, 6, 7)]
    assert torch.equal(second.kept.ids, torch.cat([ids[start:end] for start, end in spans]))
    assert torch.equal(second.kept.sizes(), torch.cat([sizes[row * columns:(row + 1) * columns]
                                                       for row in (2, 3, 6, 7)]))
