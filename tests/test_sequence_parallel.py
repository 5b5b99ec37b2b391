"""Ulysses sequence parallelism (grpo_fast.sequence_parallel): a packed row cut across gloo ranks gives one
process's loss, metrics and gradients for dapo, grpo, dr_grpo and GSPO, with and without shared prompts, the cuts
inside prompts and completions, the row padded to split evenly, key / value heads fewer than the ranks repeated;
the shards and refusals on one process."""

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast import sequence_parallel as sp  # noqa: E402
from grpo_fast.packed_attention import SharedPrompts  # noqa: E402
from tests.helpers import torchrun_json  # noqa: E402

CHECK = "tests.sequence_parallel_check"
LOSS_CASES = 5                     # tests/sequence_parallel_check.py's CASES


def packed_row():
    """Two sequences of 3 and 4 tokens; completion tokens predicted from positions 1, 2 (row 0) and 4, 5, 6 (row 1)."""
    bounds = torch.tensor([0, 3, 7], dtype=torch.int32)
    inputs = {"input_ids": torch.arange(10, 17)[None], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]]),
              "attention_mask": None, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 4,
              "max_length_k": 4}
    return inputs, torch.tensor([[1, 2, 0], [4, 5, 6]])


@pytest.mark.parametrize("size", [2, 4])
def test_shards_cover_the_padded_row_once(size):
    inputs, index = packed_row()
    pieces = [sp.shard_row(inputs, index, sp.SequenceShards(None, size, rank)) for rank in range(size)]
    padded = -7 % size + 7
    ids = torch.cat([local["input_ids"] for local, _, _ in pieces], 1)
    positions = torch.cat([local["position_ids"] for local, _, _ in pieces], 1)
    assert ids.tolist() == [list(range(10, 17)) + [0] * (padded - 7)]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3] + list(range(padded - 7))]
    for local, _, _ in pieces:
        assert local["cu_seq_lens_q"].tolist() == [0, 3, 7] + ([padded] if padded > 7 else [])
        assert local["sequence_shards"].length == padded and local["input_ids"].shape[1] == padded // size
    held = torch.stack([here for _, _, here in pieces])
    assert held.sum(0).tolist() == [[1, 1, 1], [1, 1, 1]]                   # each state on exactly one rank
    shard = padded // size
    for rank, (_, local_index, here) in enumerate(pieces):
        assert torch.equal(torch.where(here, local_index + rank * shard, index), index)
        assert (local_index[~here] == shard).all()


def test_states_here_reads_zero_where_another_rank_holds_the_state():
    hidden = torch.randn(1, 3, 4)
    states = sp.states_here(hidden, torch.tensor([[2, 3], [0, 3]]))
    assert torch.equal(states[0, 0], hidden[0, 2]) and torch.equal(states[1, 0], hidden[0, 0])
    assert (states[:, 1] == 0).all()


def test_shared_prompt_rows_get_a_padding_group():
    inputs = {"input_ids": torch.arange(5)[None], "position_ids": torch.tensor([[0, 1, 2, 2, 3]]),
              "attention_mask": None, "shared_prompts": SharedPrompts([(0, 2, [(2, 1), (3, 2)])])}
    local, _, _ = sp.shard_row(inputs, torch.tensor([[1], [1]]), sp.SequenceShards(None, 2, 0))
    assert local["shared_prompts"].groups == [(0, 2, [(2, 1), (3, 2)]), (5, 1, [])]
    assert inputs["shared_prompts"].groups == [(0, 2, [(2, 1), (3, 2)])]     # the caller's layout untouched


def test_refusals_name_what_does_not_split():
    with pytest.raises(ValueError, match=r"needs a packed row .*input_ids \(2, 5\)"):
        sp.shard_row({"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)},
                     torch.zeros(2, 1, dtype=torch.long), sp.SequenceShards(None, 2, 0))
    query, key = torch.zeros(1, 3, 4, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="sequence_parallel 4 must be at most the model's 3 attention heads"):
        sp.spread_heads(None, query, key, key, sp.SequenceShards(None, 4, 0))


def test_split_sizes_are_as_even_as_can_be():
    assert sp.split_sizes(9, 2) == [5, 4] and sp.split_sizes(8, 4) == [2, 2, 2, 2] and sp.split_sizes(3, 3) == [1] * 3
    assert sp.split_sizes(10, 4) == [3, 3, 2, 2]


def test_sums_outside_a_group_are_local():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert not sp.active()
    assert sp.sequence_sum(mask).tolist() == [[2.0], [1.0]] and float(sp.batch_sum(mask)) == 3.0


@pytest.mark.parametrize("ranks, heads, kv_heads", [(2, 4, 2), (4, 4, 1), (2, 9, 3)],
                         ids=["sp2", "sp4-kv-repeated", "sp2-uneven-heads"])
def test_sharded_micro_batch_equals_one_process(ranks, heads, kv_heads):
    result = torchrun_json(CHECK, "--heads", str(heads), "--kv-heads", str(kv_heads), nproc=ranks)
    assert result["size"] == ranks and len(result["cases"]) == 2 * LOSS_CASES
    for case in result["cases"]:
        assert case["padded"] % ranks == 0 and case["padded"] >= case["row"], case
        assert case["worst"] < 1e-5, case
    assert any(case["padded"] > case["row"] for case in result["cases"])       # a padded row among them
    assert "kl" in result["cases"][-1]["metrics"] and "entropy" in result["cases"][-1]["metrics"]


def test_without_the_group_sums_the_shards_disagree():
    """The control: each rank's sums over its own tokens alone (no summing_over) miss the normalizers, the
    sequence log-ratios and the metrics' means, which the check above would catch."""
    result = torchrun_json(CHECK, "--local-sums", nproc=2)
    assert all(case["worst"] > 1e-2 for case in result["cases"]), [case["worst"] for case in result["cases"]]
