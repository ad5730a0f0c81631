"""Worker for tests/test_vision_policy.py, run under torchrun with 2 processes (several layouts in one process group).

For each layout (TP x PP; extra ranks are data-parallel replicas) it builds the tiny LLaVA's Megatron chunks from
the HF directory (the spec's "model", or the layout's own) and
- exports them with `export_hf_weights` and compares every tensor bitwise with the checkpoint (names included);
- runs the batch the test saved (rows with images at the start and in the middle, `pixel_values`) and saves the
  TP-gathered logits; at PP=1 also the documents packed as THD, and at PP=2 through Megatron's pipeline schedule;
- ("grads") the gradients of sum(logits * w) of every parameter, TP-gathered and named as the checkpoint's
  tensors, end to end and with `freeze_vision`;
- ("save_hf") writes an HF directory with `save_hf_checkpoint`; ("save_mcore") a Megatron distributed checkpoint,
  which a later layout ("load_mcore": the saving layout's name) loads and exports bitwise;
- ("critic_hf") the critic's values, its Hugging Face export, and the values of the critic built from that;
- ("decode") the colocated rollout (`vision.decode.decode`): greedy and sampled tokens restricted to the last ids
  after left-padded prompts with images, and their log-probs.
pytest compares the logits and gradients with transformers run on the same model.

Usage: torchrun --nproc_per_node=2 tests/scripts/vision_check.py --spec SPEC.json --out DIR
"""
from pathlib import Path

import torch
import torch.distributed as dist
from models_check import main as run_spec

from rlhf_mcore.parallel import init_distributed


def gather_vocab(out, state):
    """Vocabulary-parallel logits (..., V / TP) -> (..., V)."""
    if state.dims.tp == 1:
        return out
    parts = [torch.empty_like(out) for _ in range(state.dims.tp)]
    dist.all_gather(parts, out.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=-1)


def pipeline_logits(chunks, state, ids, pix):
    """Forward-only through Megatron's pipeline schedule; the last stage returns the gathered logits."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)

    def step(data_iter, model):
        next(data_iter)
        out = model(ids, pos, None, pixel_values=pix)
        return out, lambda output: (output.sum() * 0.0, {"out": output.detach().clone()})

    with torch.no_grad():
        res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(range(1)), model=chunks[0],
                                          num_microbatches=1, seq_length=ids.shape[1],
                                          micro_batch_size=ids.shape[0], forward_only=True)
    return gather_vocab(res[0]["out"], state) if state.is_last_stage else None


def packed(docs, images):
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.tensor([len(d) for d in docs])
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])[None]
    mx = int(lens.max())
    return ids, pos, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx,
                                     max_seqlen_kv=mx), torch.stack(images)


def roundtrip(chunks, state, hf_dir, unread_missing=False):
    """Problems of export vs checkpoint (empty: every tensor, and no other, bitwise equal). unread_missing: the
    tensors no parameter holds may be missing (a model built from a Megatron checkpoint's weight-less hf_meta/)."""
    from safetensors.torch import load_file

    from rlhf_mcore.models import export_hf_weights

    want = load_file(str(Path(hf_dir) / "model.safetensors"))
    problems, seen = [], set()
    for name, tensor in export_hf_weights(chunks, state):
        seen.add(name)
        ref = want.get(name)
        if ref is None:
            problems.append(f"unexpected {name}")
        elif ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(ref, tensor):
            problems.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype} vs {tuple(ref.shape)} {ref.dtype}")
    missing = set(want) - seen
    if unread_missing:
        from rlhf_mcore.models.vision.weights import passthrough_names

        missing -= set(passthrough_names(chunks[0].hf_shape.vision, chunks[0].hf_layout, want))
    return problems + [f"not exported: {n}" for n in sorted(missing)]


def hf_named_grads(chunk, state):
    """{checkpoint tensor name: gradient (TP-gathered) or None} for every parameter of a PP=1 chunk."""
    from rlhf_mcore.models.hf_loader import chunk_param_rule, layer_numbers
    from rlhf_mcore.models.weight_map import join_tp_shards, rule_shape, split_to_hf

    out = {}
    layers = layer_numbers(chunk)
    for name, param in chunk.named_parameters():
        rule = chunk_param_rule(chunk, name, layers, chunk.hf_shape, chunk.model_role)
        if not rule.exported:
            continue
        grad = param.grad
        if grad is None:
            out.update({n: None for n in rule.hf_names})
            continue
        if state.dims.tp > 1 and rule.kind != "replicated":
            parts = [torch.empty_like(grad) for _ in range(state.dims.tp)]
            dist.all_gather(parts, grad.contiguous(), group=state.tp_group)
            grad = join_tp_shards(parts, rule)
        out.update({n: g.clone() for n, g in split_to_hf(grad, rule, rule_shape(rule, chunk.hf_shape))})
    return out


def grads(state, hf_dir, ids, pix, weights, freeze):
    from rlhf_mcore.models import build_model

    (chunk,) = build_model(hf_dir, state, freeze_vision=freeze)
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    logits = chunk(ids, pos, None, pixel_values=pix)  # (B, S, V / TP)
    v = logits.shape[-1]
    w = weights[..., state.tp_rank * v:(state.tp_rank + 1) * v]
    (logits * w).sum().backward()  # the TP ranks' partial sums: Megatron's backward all-reduces the input grads
    return hf_named_grads(chunk, state)


def run_layout(layout, spec, out: Path, results: dict):
    from rlhf_mcore.models import build_model, save_hf_checkpoint

    name, tp, pp = layout["name"], layout["tp"], layout["pp"]
    state = init_distributed(tp=tp, pp=pp, seed=3)
    hf_dir = layout.get("model", spec["model"])  # a layout may run another LLaVA directory (other text models)
    batch = torch.load(spec["batch"])
    ids, pix = batch["ids"], batch["pixel_values"]
    res = results.setdefault(name, {})
    report = state.is_last_stage and state.tp_rank == 0 and state.dp_rank == 0
    chunks = build_model(hf_dir, state)
    res["roundtrip"] = [f"rank{state.rank}: {p}" for p in roundtrip(chunks, state, hf_dir)]
    everyone = [None] * state.world_size
    dist.all_gather_object(everyone, res["roundtrip"])
    res["roundtrip"] = [p for ps in everyone for p in ps]
    saved = {}
    if pp > 1:
        saved["logits"] = pipeline_logits(chunks, state, ids, pix)
    else:
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        with torch.no_grad():
            saved["logits"] = gather_vocab(chunks[0](ids, pos, None, pixel_values=pix), state)
            pids, ppos, psp, ppix = packed(batch["docs"], batch["doc_images"])
            saved["packed"] = gather_vocab(chunks[0](pids, ppos, None, packed_seq_params=psp, pixel_values=ppix),
                                           state)[0]
            saved["cu"] = psp.cu_seqlens_q
    stages = [None] * state.world_size
    dist.all_gather_object(stages, [state.pp_rank, chunks[0].vision_model is not None])
    res["vision_on_stage"] = stages
    extras = layout.get("extras", [])
    if "save_hf" in extras:
        save_hf_checkpoint(chunks, state, out / f"{name}_hf", hf_dir)
    if "save_mcore" in extras:
        from rlhf_mcore.models import save_mcore_checkpoint

        save_mcore_checkpoint(chunks, state, out / f"{name}_mcore", hf_dir)
    if "load_mcore" in layout:  # a Megatron checkpoint saved by an earlier layout, loaded under this one
        from rlhf_mcore.models import load_mcore_checkpoint

        src = out / f"{layout['load_mcore']}_mcore"
        fresh = build_model(src / "hf_meta", state, load_weights=False)
        load_mcore_checkpoint(fresh, src)
        problems = [f"rank{state.rank}: {p}" for p in roundtrip(fresh, state, hf_dir, unread_missing=True)]
        everyone = [None] * state.world_size
        dist.all_gather_object(everyone, problems)
        res["from_mcore"] = [p for ps in everyone for p in ps]
        del fresh
    if "decode" in extras:
        from rlhf_mcore.models.vision.decode import decode

        d = batch["decode"]
        kw = dict(new_tokens=d["new_tokens"], token_range=tuple(d["token_range"]), prompt_mask=d["prompt_mask"])
        saved["greedy"] = decode(chunks, state, d["ids"], d["pixel_values"], temperature=0.0, **kw)
        saved["sampled"] = decode(chunks, state, d["ids"], d["pixel_values"], temperature=d["temperature"],
                                  generator=torch.Generator().manual_seed(7), **kw)
    del chunks
    if "critic_hf" in extras:  # the critic's values, its HF export, and the values of the critic built from that
        critic = build_model(hf_dir, state, role="critic")
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        with torch.no_grad():
            saved["critic_values"] = critic[0](ids, pos, None, pixel_values=pix)
        with torch.no_grad():  # a head that is not the initialisation's, so reading it back is visible
            critic[0].output_layer.weight.add_(0.5)
            saved["critic_values_trained"] = critic[0](ids, pos, None, pixel_values=pix)
        save_hf_checkpoint(critic, state, out / f"{name}_critic_hf", hf_dir)
        again = build_model(out / f"{name}_critic_hf", state, role="critic")
        with torch.no_grad():
            saved["critic_values_reloaded"] = again[0](ids, pos, None, pixel_values=pix)
        del critic, again
    if "grads" in extras:
        saved["grads"] = grads(state, hf_dir, ids, pix, batch["weights"], freeze=False)
        saved["grads_frozen"] = grads(state, hf_dir, ids, pix, batch["weights"], freeze=True)
    if report:
        torch.save(saved, out / f"{name}.pt")
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()


if __name__ == "__main__":
    run_spec(run_layout)
