"""Worker for tests/test_models.py, run under torchrun (several TP×PP layouts inside one process group).

For every layout and tiny HF model it builds the Megatron chunks from the HF directory and
- runs Megatron's pipeline schedule forward-only on the same documents three ways (a plain batch with no
  mask, a left-padded batch with a causal+padding mask, the documents packed as THD) and saves the
  TP-gathered logits (over the padded vocabulary) for pytest to compare with transformers;
- exports HF tensors with `export_hf_weights` and compares them bitwise with the checkpoint, on every rank.
Every rank reports the global layers it holds of each model. Per-layout extras (the spec's "extras",
"readlog" and "load_mcore"): slice-wise loading with a ReadLog from a sharded checkpoint, bf16 checkpoints in
fp32 and bf16 models, HF checkpoint saves, Megatron dist checkpoint saves, loading a Megatron dist checkpoint
written under another layout (by the CLI, or by an earlier layout of this run), the critic, and gradients of
padded vs packed batches.

Usage: torchrun --nproc_per_node=4 tests/scripts/models_check.py --spec SPEC.json --out DIR
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_mcore.parallel import destroy_distributed, init_distributed

PAD_ID = 0


def documents(spec):
    """The test documents (token id lists), the same on every rank."""
    g = torch.Generator().manual_seed(spec["seed"])
    return [torch.randint(1, spec["max_token"], (n,), generator=g) for n in spec["doc_lens"]]


def padded_batch(docs, left: bool):
    """(ids (B, S), positions (B, S), mask (B, 1, S, S) True = masked, or None when nothing is padded)."""
    s = max(len(d) for d in docs)
    ids = torch.full((len(docs), s), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(docs), s, dtype=torch.bool)
    for i, d in enumerate(docs):
        sl = slice(s - len(d), s) if left else slice(0, len(d))
        ids[i, sl], valid[i, sl] = d, True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    if valid.all():
        return ids, positions, None
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    allowed = causal[None] & valid[:, None, :]  # (B, S, S): key is earlier and real
    return ids, positions, ~allowed[:, None]


def packed_batch(docs):
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.tensor([len(d) for d in docs])
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    ids = torch.cat(docs)[None]  # (1, T)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])[None]
    mx = int(lens.max())
    return ids, positions, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx,
                                           max_seqlen_kv=mx)


def run_forward(chunks, state, ids, positions, mask, psp, hidden_hook=False):
    """Forward-only through Megatron's schedule; on the last stage returns the full-vocabulary output (B, S, V')
    (TP-gathered), else None. hidden_hook: also return the input of the output layer (S, B, H)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = {}
    handle = None
    last = chunks[-1]
    if hidden_hook and last.post_process:
        handle = last.output_layer.register_forward_pre_hook(lambda m, args: captured.__setitem__("h", args[0]))

    def step(data_iter, model):
        next(data_iter)
        out = model(ids, positions, mask, packed_seq_params=psp)

        def loss_func(output):
            return output.sum() * 0.0, {"out": output.detach().clone()}
        return out, loss_func

    fb = get_forward_backward_func()
    # the interleaved (virtual PP) schedule wants at least PP micro-batches: repeat the batch, keep the first
    n_micro = state.dims.pp if len(chunks) > 1 else 1
    iters = [iter(range(n_micro)) for _ in chunks] if len(chunks) > 1 else iter(range(n_micro))
    with torch.no_grad():
        res = fb(forward_step_func=step, data_iterator=iters, model=chunks if len(chunks) > 1 else chunks[0],
                 num_microbatches=n_micro, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                 forward_only=True)
    if handle is not None:
        handle.remove()
    if not state.is_last_stage:
        return None
    out = res[0]["out"]
    if out.shape[-1] > 1 and state.dims.tp > 1:  # vocabulary-parallel logits
        parts = [torch.empty_like(out) for _ in range(state.dims.tp)]
        dist.all_gather(parts, out.contiguous(), group=state.tp_group)
        out = torch.cat(parts, dim=-1)
    return (out, captured.get("h")) if hidden_hook else out


def reporter(state) -> bool:
    return state.is_last_stage and state.tp_rank == 0 and state.dp_rank == 0


def roundtrip(chunks, state, hf_dir, role="actor", dtype=None):
    """Export and compare with the checkpoint: returns a list of problems (empty = bitwise identical)."""
    from safetensors import safe_open

    from rlhf_mcore.models import export_hf_weights
    from rlhf_mcore.models.hf_loader import SafetensorsCheckpoint
    from rlhf_mcore.models.weight_map import expected_hf_names

    ckpt = SafetensorsCheckpoint(hf_dir)
    problems, seen = [], []
    for name, tensor in export_hf_weights(chunks, state, dtype=dtype):
        seen.append(name)
        if name not in ckpt:
            if role != "critic":
                problems.append(f"unexpected {name}")
            continue
        with safe_open(str(Path(hf_dir) / ckpt.weight_map[name]), "pt") as f:
            ref = f.get_tensor(name)
        if ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(ref, tensor.cpu()):
            problems.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype} vs {tuple(ref.shape)} {ref.dtype}")
    want = expected_hf_names(chunks[0].hf_shape, role)
    if seen != want:
        problems.append(f"names/order differ: got {seen[:6]}..., want {want[:6]}...")
    if role != "critic" and set(seen) != set(ckpt.weight_map):
        problems.append(f"checkpoint tensors not exported: {sorted(set(ckpt.weight_map) - set(seen))}")
    return problems


def gather_problems(state, problems):
    allp = [None] * state.world_size
    dist.all_gather_object(allp, problems)
    return [f"rank{r}: {p}" for r, ps in enumerate(allp) for p in ps]


def run_layout(layout, spec, out: Path, results: dict):
    from rlhf_mcore.models import build_model, load_hf_weights, save_hf_checkpoint
    from rlhf_mcore.models.hf_loader import ReadLog

    tp, pp, vpp = layout["tp"], layout["pp"], layout.get("vpp")
    name = layout["name"]
    state = init_distributed(tp=tp, pp=pp, vpp=vpp, seed=3)
    docs = documents(spec)
    res = results.setdefault(name, {})
    for model_name in layout["models"]:
        hf_dir = spec["models"][model_name]
        chunks = build_model(hf_dir, state, role="actor")
        res[f"{model_name}/roundtrip"] = gather_problems(state, roundtrip(chunks, state, hf_dir))
        held = [None] * state.world_size
        dist.all_gather_object(held, [state.pp_rank, [layer.layer_number - 1 for c in chunks
                                                      for layer in c.decoder.layers]])
        res[f"{model_name}/layers"] = held
        if not layout.get("skip_forward"):
            cases = {"plain": padded_batch([docs[0], docs[2]], left=True),  # equal lengths: no mask
                         "left_padded": padded_batch(docs, left=True)}
            for case, (ids, pos, mask) in cases.items():
                logits = run_forward(chunks, state, ids, pos, mask, None)
                if reporter(state):
                    torch.save({"logits": logits, "ids": ids, "mask": mask}, out / f"{name}_{model_name}_{case}.pt")
            ids, pos, psp = packed_batch(docs)
            logits = run_forward(chunks, state, ids, pos, None, psp)
            if reporter(state):
                torch.save({"logits": logits, "cu": psp.cu_seqlens_q}, out / f"{name}_{model_name}_thd.pt")
        extras = layout.get("extras", {}).get(model_name, [])
        if "save_hf" in extras:
            save_hf_checkpoint(chunks, state, out / f"{name}_{model_name}_hf", hf_dir, max_shard_bytes=40_000)
        if "save_mcore" in extras:
            from rlhf_mcore.models import save_mcore_checkpoint

            save_mcore_checkpoint(chunks, state, out / f"{name}_{model_name}_mcore", hf_dir)
        if "from_mcore" in extras:
            res[f"{model_name}/from_mcore_roundtrip"] = from_mcore(state, spec["mcore"][model_name], hf_dir,
                                                                   out / f"{name}_{model_name}_from_mcore_hf")
        if "grads" in extras:
            res[f"{model_name}/grads"] = padded_vs_packed_grads(chunks, state, docs)
        if "critic" in extras:
            res[f"{model_name}/critic"] = check_critic(chunks, state, hf_dir, docs, out / f"{name}_{model_name}")
        del chunks
    for model_name in layout.get("bf16", []):  # a bf16 checkpoint: fp32 params (CPU default), then bf16 params
        hf_dir = spec["models"][model_name]
        chunks = build_model(hf_dir, state)
        res[f"{model_name}/default_param_dtype"] = str(next(chunks[0].parameters()).dtype)
        res[f"{model_name}/fp32_roundtrip"] = gather_problems(
            state, roundtrip(chunks, state, hf_dir, dtype=torch.bfloat16))
        chunks = build_model(hf_dir, state, dtype=torch.bfloat16)
        res[f"{model_name}/bf16_param_dtypes"] = sorted({str(p.dtype) for c in chunks for p in c.parameters()})
        res[f"{model_name}/bf16_roundtrip"] = gather_problems(state, roundtrip(chunks, state, hf_dir))
        del chunks
    for model_name in layout.get("readlog", []):
        hf_dir = spec["models"][model_name]
        chunks = build_model(hf_dir, state, load_weights=False)
        log = ReadLog()
        load_hf_weights(chunks, hf_dir, state, read_log=log)
        mine = {"tp_rank": state.tp_rank, "pp_rank": state.pp_rank, "dp_rank": state.dp_rank,
                "layers": sorted(layer.layer_number - 1 for c in chunks for layer in c.decoder.layers),
                "reads": log.numel_by_name(), "n_reads": len(log.reads)}
        everyone = [None] * state.world_size
        dist.all_gather_object(everyone, mine)
        res[f"{model_name}/readlog"] = everyone
        res[f"{model_name}/readlog_roundtrip"] = gather_problems(state, roundtrip(chunks, state, hf_dir))
        del chunks
    for model_name, saved_at in layout.get("load_mcore", {}).items():
        res[f"{model_name}/from_mcore_roundtrip"] = from_mcore(
            state, out / f"{saved_at}_{model_name}_mcore", spec["models"][model_name],
            out / f"{name}_{model_name}_from_mcore_hf")
    from megatron.core import parallel_state as mpu
    mpu.destroy_model_parallel()


def from_mcore(state, mcore_dir, hf_dir, out_hf):
    """Load a Megatron dist checkpoint (saved under another layout) and compare its export with the HF
    checkpoint; also convert it back to HF with launch/convert_checkpoint.py's `mcore_to_hf`."""
    import importlib.util

    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.mcore_checkpoint import HF_META, load_mcore_checkpoint

    chunks = build_model(Path(mcore_dir) / HF_META, state, load_weights=False)
    load_mcore_checkpoint(chunks, mcore_dir)
    problems = gather_problems(state, roundtrip(chunks, state, hf_dir))
    path = Path(__file__).resolve().parents[2] / "launch" / "convert_checkpoint.py"
    module_spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    convert = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(convert)
    convert.mcore_to_hf(mcore_dir, out_hf, state)
    return problems


def check_critic(actor_chunks, state, hf_dir, docs, prefix: Path):
    """Critic: width-1 head, trunk equal to the actor's; HF export as *ForTokenClassification."""
    from rlhf_mcore.models import build_model, export_hf_weights, save_hf_checkpoint

    critic = build_model(hf_dir, state, role="critic")
    ids, pos, mask = padded_batch(docs, left=True)
    a = run_forward(actor_chunks, state, ids, pos, mask, None, hidden_hook=True)
    c = run_forward(critic, state, ids, pos, mask, None, hidden_hook=True)
    info = {"export_names": [n for n, _ in export_hf_weights(critic, state)][-3:]}
    if state.is_last_stage:
        (_, h_actor), (values, h_critic) = a, c
        head = critic[-1].output_layer
        info.update(values_shape=list(values.shape), head_weight_shape=list(head.weight.shape),
                    trunk_max_diff=(h_actor - h_critic).abs().max().item(),
                    head_max_diff=(values - (h_critic @ head.weight.T + head.bias).transpose(0, 1)).abs().max().item(),
                    n_params_head=sum(p.numel() for p in head.parameters()))
        if reporter(state):
            torch.save({"values": values, "ids": ids, "mask": mask}, f"{prefix}_critic_values.pt")
    save_hf_checkpoint(critic, state, f"{prefix}_critic_hf", hf_dir)
    allinfo = [None] * state.world_size
    dist.all_gather_object(allinfo, info)
    return allinfo


def padded_vs_packed_grads(chunks, state, docs):
    """TP=PP=1 only: parameter gradients of the same per-token loss on a right-padded batch and on the packed
    documents; returns the largest difference and the largest gradient."""
    (chunk,) = chunks
    ids, pos, mask = padded_batch(docs, left=False)
    weights = torch.linspace(0.5, 1.5, ids.numel()).view(ids.shape)

    def grads(logits_per_doc):
        loss = sum((torch.logsumexp(lg, -1) * w).sum() for lg, w in logits_per_doc)
        chunk.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in chunk.named_parameters()}

    out = chunk(ids, pos, mask)
    g_pad = grads([(out[i, :len(d)], weights[i, :len(d)]) for i, d in enumerate(docs)])
    pids, ppos, psp = packed_batch(docs)
    out = chunk(pids, ppos, None, packed_seq_params=psp)[0]
    bounds = psp.cu_seqlens_q.tolist()
    g_thd = grads([(out[a:b], weights[i, :b - a]) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
    return {"max_diff": max((g_pad[n] - g_thd[n]).abs().max().item() for n in g_pad),
            "max_grad": max(g.abs().max().item() for g in g_pad.values()),
            "finite": all(bool(torch.isfinite(g).all()) for g in g_pad.values())}


def main(run_layout=run_layout):
    """`--spec SPEC --out DIR`: `run_layout(layout, spec, out, results)` for each of the spec's layouts, then rank 0
    writes DIR/results.json (tests/scripts/moe_check.py runs its own layouts through this too)."""
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    out = Path(args.out)
    results = {}
    for layout in spec["layouts"]:
        t0 = time.perf_counter()
        run_layout(layout, spec, out, results)
        if dist.get_rank() == 0:
            print(f"layout {layout['name']}: {time.perf_counter() - t0:.1f}s", flush=True)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main()
