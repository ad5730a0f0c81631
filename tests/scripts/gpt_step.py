"""Worker for tests/test_parallel.py, run under torchrun: build a small Megatron GPTModel at the requested
TP/PP, load the same full initial weights as every other layout, run forward+backward+one optimizer step through
get_forward_backward_func, then a forward-only pass; rank 0 writes the losses as JSON.

Usage: torchrun --nproc_per_node=N tests/scripts/gpt_step.py --out FILE --layouts 1x1,2x1,...
Several layouts run inside one process group (re-initialising Megatron's parallel state) to save start-up time.
"""
import argparse
import zlib

import torch
import torch.distributed as dist
from worker_common import write_results

from rlhf_mcore.parallel import destroy_distributed, init_distributed

VOCAB, HIDDEN, HEADS, KV, LAYERS, FFN, SEQ, GLOBAL_BATCH = 128, 32, 4, 2, 4, 64, 16, 8


def build(state, dist_opt: bool, tied: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV, ffn_hidden_size=FFN,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=state.dims.tp, pipeline_model_parallel_size=state.dims.pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
        bf16=False, fp16=False)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=state.is_first_stage,
                     post_process=state.is_last_stage, share_embeddings_and_output_weights=tied,
                     position_embedding_type="rope", pg_collection=state.pg_collection)
    load_reference_weights(model, state)
    model.to(state.device)
    ddp = DistributedDataParallel(
        config=cfg, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=dist_opt,
                                                             grad_reduce_in_fp32=True), module=model)
    # what Megatron's own training loop wires up: DP grad reduction (and tied-embedding / layernorm
    # all-reduces) happens in finalize_model_grads, called by the schedule at the end of the step
    from megatron.core.distributed import finalize_model_grads
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=dist_opt,
                                                 clip_grad=1.0, bf16=False, params_dtype=torch.float32), [ddp])
    return cfg, ddp, opt


def full_tensor(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("layer_norm_weight") or name.endswith("final_layernorm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.05 * torch.randn(shape, generator=g)


def load_reference_weights(model, state):
    """Each rank fills its shard from the same full tensors, named by global layer index."""
    per_stage = LAYERS // state.dims.pp
    tp, r = state.dims.tp, state.tp_rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + state.pp_rank * per_stage)
                gname = ".".join(parts)
            if not getattr(p, "tensor_model_parallel", False):
                p.copy_(full_tensor(gname, p.shape))
                continue
            dim = p.partition_dim
            shape = list(p.shape)
            shape[dim] *= tp
            full = full_tensor(gname, shape)
            if "linear_fc1" in name:  # [gate; up]: each rank holds [gate_r; up_r]
                gate, up = full.chunk(2, dim=0)
                p.copy_(torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0))
            else:
                p.copy_(full.chunk(tp, dim=dim)[r])


def batch(state):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per_dp = GLOBAL_BATCH // state.dims.dp
    mine = tokens[state.dp_rank * per_dp:(state.dp_rank + 1) * per_dp]
    return [mine[i:i + 1] for i in range(per_dp)]  # micro-batches of one sequence


def run_step(state, forward_only: bool, model, micro):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=state.device), 1)[None, None]
    positions = torch.arange(SEQ, device=state.device)[None]

    def forward_step(data_iter, m):
        seq = next(data_iter).to(state.device)
        inp, labels = seq[:, :-1], seq[:, 1:]
        out = m(inp, positions, causal, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place
        return out, loss_func

    fb = get_forward_backward_func()
    losses = fb(forward_step_func=forward_step, data_iterator=iter(micro), model=model,
                num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=1, forward_only=forward_only)
    if state.is_last_stage:
        mean = torch.stack([d["loss"] for d in losses]).mean()
    else:
        mean = torch.zeros((), device=state.device)
    # the loss lives on the last stage: share it along the pipeline, then average over DP
    dist.all_reduce(mean, group=state.pp_group)
    dist.all_reduce(mean, group=state.dp_group)
    return (mean / state.dims.dp).item()


def run_layout(tp, pp, dist_opt, tied):
    state = init_distributed(tp=tp, pp=pp, seed=7)
    cfg, ddp, opt = build(state, dist_opt, tied)
    micro = batch(state)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss0 = run_step(state, False, ddp, micro)
    # every TP rank must see the same loss
    seen = [None] * state.dims.tp
    dist.all_gather_object(seen, loss0, group=state.tp_group)
    ok, grad_norm, _ = opt.step()
    loss1 = run_step(state, True, ddp, micro)
    result = {"loss0": loss0, "loss1": loss1, "tp_losses": seen, "update_ok": bool(ok), "grad_norm": float(grad_norm)}
    from megatron.core import parallel_state as mpu
    mpu.destroy_model_parallel()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True,
                    help="comma list of TPxPP[:dist][:tied], e.g. 1x1,2x1:dist,1x2:tied")
    args = ap.parse_args()
    results = {}
    for spec in args.layouts.split(","):
        lay, *flags = spec.split(":")
        tp, pp = map(int, lay.split("x"))
        results[spec] = run_layout(tp, pp, "dist" in flags, "tied" in flags)
    write_results(results, args.out, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
