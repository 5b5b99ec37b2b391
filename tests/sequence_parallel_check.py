"""One packed micro-batch under Ulysses sequence parallelism on gloo ranks against the same micro-batch in one
process: every rank runs the decoder on its shard of the row (grpo_fast.sequence_parallel) and the fused loss on
the tokens it holds, inside summing_over(group); the loss (summed over ranks), its metrics and every parameter's
gradient (summed over ranks) must equal one process's. Every rank computes the one-process reference itself.

Rank 0 prints one JSON line: per case, the loss both ways and the largest relative error of the loss, the
metrics and the parameters' gradients (each parameter's norm of the difference over its gradient's norm).

    torchrun --nproc_per_node 2 -m tests.sequence_parallel_check [--heads 9 --kv-heads 3] [--local-sums]
"""

import argparse
import contextlib
import json

import torch
import torch.distributed as dist

import grpo_fast as gf
from grpo_fast import packed_attention as attention
from grpo_fast import sequence_parallel as sp
from grpo_fast.train.distributed import HiddenStates
from grpo_fast.train.update import batching
from tests.helpers import grouped_generation

# prompts and completions of three groups and a group of one; lengths chosen so the shards' cuts fall inside
# prompts and completions and the row needs padding to split evenly
PROMPTS = [7, 5, 9, 4]
COMPLETIONS = [[6, 1, 4], [5, 8], [3, 7, 2], [9]]
CASES = [("dapo", {}), ("grpo", {}), ("dr_grpo", {"max_completion_length": 9}),
         ("grpo", {"importance_sampling_level": "sequence"}), ("dapo", {"beta": 0.04, "entropy_coef": 0.01})]


def rollout(vocab: int):
    generator = torch.Generator().manual_seed(0)
    generation = grouped_generation(PROMPTS, COMPLETIONS, vocab, generator)
    advantages = torch.randn(len(generation.input_ids), 1, generator=generator)
    shape = generation.completion_ids.shape
    old_offset = 0.3 * torch.randn(shape, generator=generator)       # moves the ratio so clipping acts
    ref_offset = 0.2 * torch.randn(shape, generator=generator)
    return generation, advantages, old_offset, ref_offset


def model_of(vocab: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    attention.use_varlen_attention(model, "cpu")
    return model


def loss_and_grads(model, hidden, generation, micro, advantages, old_logps, ref_logps, config, mask):
    model.zero_grad(set_to_none=True)
    ids = micro.completion(generation.completion_ids)
    loss, metrics = gf.grpo_loss(hidden, model.lm_head.weight, ids, advantages, mask,
                                 old_logps=micro.completion(old_logps), ref_logps=micro.completion(ref_logps),
                                 config=config)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), {name: value.detach() for name, value in metrics.items()}, grads


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--local-sums", action="store_true",
                        help="the loss's sums over this rank's tokens alone (what summing_over corrects)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    vocab = 50
    model = model_of(vocab, args.heads, args.kv_heads)
    trunk = HiddenStates(model)
    generation, advantages, old_offset, ref_offset = rollout(vocab)
    with torch.no_grad():
        full = batching.micro_batch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                                    list(range(len(advantages))), packed=True)
        logps = torch.zeros(generation.completion_ids.shape)
        logps[:, :full.completion_length] = gf.token_logprobs(batching.completion_hidden_states(trunk, full),
                                                              model.lm_head.weight,
                                                              full.completion(generation.completion_ids))
    old_logps, ref_logps = logps + old_offset, logps + ref_offset
    shards = sp.SequenceShards.of()
    results = []
    for share_prompts in (False, True):
        micro = batching.micro_batch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                                     list(range(len(advantages))), packed=True, share_prompts=share_prompts)
        mask = micro.completion(generation.completion_mask)
        for loss_type, options in CASES:
            config = gf.LossConfig(loss_type=loss_type, **options)
            hidden = batching.completion_hidden_states(trunk, micro)
            want = loss_and_grads(model, hidden, generation, micro, advantages, old_logps, ref_logps, config, mask)
            inputs, index, local = sp.shard_row(micro.model_inputs, micro.hidden_index, shards)
            hidden = sp.states_here(trunk(**inputs), index)
            with sp.summing_over(None) if not args.local_sums else contextlib.nullcontext():
                loss, metrics, grads = loss_and_grads(model, hidden, generation, micro, advantages, old_logps,
                                                      ref_logps, config, mask & local)
            dist.all_reduce(loss)
            for grad in grads.values():
                dist.all_reduce(grad)
            errors = [relative(loss, want[0])] + [relative(metrics[name], value) for name, value in want[1].items()]
            errors += [relative(grads[name], grad) for name, grad in want[2].items()]
            results.append({"loss_type": loss_type, "options": options, "share_prompts": share_prompts,
                            "row": int(micro.model_inputs["input_ids"].shape[1]),
                            "padded": inputs["sequence_shards"].length,
                            "loss": float(loss), "want": float(want[0]), "metrics": sorted(metrics),
                            "worst": max(errors), "local_tokens": int((mask & local).sum())})
    if dist.get_rank() == 0:
        print(json.dumps({"size": shards.size, "heads": args.heads, "kv_heads": args.kv_heads, "cases": results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
