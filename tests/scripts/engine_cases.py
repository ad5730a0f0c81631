"""Worker for tests/test_engine.py, run under torchrun: TrainEngine cases on a tiny HF model at several layouts.

Usage: torchrun --nproc_per_node=N tests/scripts/engine_cases.py --model DIR --out DIR --cases c1,c2,...

A case is `<name>@<TPxPP[vV]>`, e.g. `layout@2x1`, `layout@1x2v2` (virtual PP 2), `grads@1x1`. Several cases run in
one launch (Megatron's parallel state is re-initialised per case) because start-up dominates on 2 cores. Rank 0
writes `<out>/results.json` (`{case: {...}}`) and tensors as `<out>/<case>.pt`; the test compares them.

Cases:
- hf: transformers' log-softmax gather and entropy of the batch (the reference).
- layout: log-probs/entropy (packed, padded, dynamic micro-batches; without PP also on a batch whose rows share
  prompts, whole rows against shared-prompt packing), then 2 PPO updates on this rank's DP share
  (2 epochs of one mini-batch each; KL loss and entropy bonus on); exports the updated weights; checks
  replicated parameters are bitwise equal across TP ranks.
- grads: packed vs padded gradients; 1×8 vs 8×1 vs token-budget micro-batches (gradients and the update).
- offload: offload/onload between two updates vs two plain updates (bitwise).
- critic: the value head fits a constant return.
- ckpt: update once, save (this layout), update again; then rebuild at TP=1 (same world, so DP grows), load
  with optimizer, compare log-probs and the next update.
- logprob_tp: `vocab_parallel_logprobs` over this layout's TP group against a full softmax (fp64) of the same
  logits: log-probs, entropy and each rank's gradient slice, with padded vocabularies (one rank holding
  padding only), temperatures, row subsets and chunking.
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

TEMPERATURE = 0.8
B, P, R = 8, 6, 8


def make_batch(vocab: int, seed: int = 0) -> dict:
    """Left-padded prompts (2..6 tokens) + right-padded responses (1..8 tokens), veRL's layout."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        prompt_len, resp_len = 2 + (b * 5) % (P - 1), 1 + (b * 3 + 2) % R
        mask[b, P - prompt_len:P] = 1
        mask[b, P:P + resp_len] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, P:].clone(), "response_mask": mask[:, P:].clone()}


def add_ppo_fields(batch: dict, log_probs: torch.Tensor) -> dict:
    """Old/ref log-probs near the current ones (some tokens clip) and fixed advantages."""
    g = torch.Generator().manual_seed(11)
    m = batch["response_mask"].float()
    noise_old, noise_ref, adv = (torch.randn(B, R, generator=g) for _ in range(3))
    return {**batch, "old_log_probs": (log_probs + 0.05 * noise_old) * m,
            "ref_log_prob": (log_probs + 0.1 * noise_ref) * m, "advantages": adv * m}


def ppo_share(model_dir, state) -> dict:
    """This DP rank's share of the PPO batch whose old / ref log-probs are near the model's own (a reference pass)."""
    batch = make_batch(tokenizer_vocab(model_dir))
    probe = build(state, model_dir, actor_config(role="ref"), role="ref")
    lp, _ = probe.compute_log_probs(batch)
    del probe
    return dp_share(add_ppo_fields(batch, lp), state)


def dp_share(batch: dict, state) -> dict:
    per = B // state.dims.dp
    lo = state.dp_rank * per
    return {k: v[lo:lo + per] for k, v in batch.items()}


def actor_config(**kw):
    from rlhf_mcore.engine import EngineConfig

    base = dict(role="actor", temperature=TEMPERATURE, micro_batch_size=1, mini_batch_size=None,
                entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, logprob_chunk_size=5)
    base.update(kw)
    return EngineConfig(**base)


def optim_config(lr: float):
    """Adam with eps=1e-4: Adam's step `g / (|g| + eps)` amplifies rounding noise in near-zero gradients by
    1/eps, so comparing updates of differently-split but equal gradients needs a bounded amplification
    (fp32 noise ~2e-7 in g becomes ~2e-3 · lr in the update)."""
    from rlhf_mcore.config import OptimConfig

    return OptimConfig(lr=lr, weight_decay=0.01, eps=1e-4)


def build(state, model_dir, cfg, role="actor", load=True, lr=1e-4):
    from rlhf_mcore.engine import TrainEngine
    from rlhf_mcore.models import build_model

    chunks = build_model(model_dir, state, role=role, load_weights=load)
    return TrainEngine(chunks, state, cfg, None if role == "ref" else optim_config(lr))


def exported(engine) -> dict:
    return {name: t.detach().clone().cpu() for name, t in engine.export_hf_weights()}


def tokenizer_vocab(model_dir) -> int:
    from rlhf_mcore.models.tiny import default_tokenizer_vocab

    return default_tokenizer_vocab(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def tp_replicas_equal(engine, state) -> int:
    """How many replicated (non-TP-split) parameters differ bitwise between TP ranks (0 when TP=1)."""
    if state.dims.tp == 1:
        return 0
    bad = 0
    for chunk in engine.chunks:
        for _, p in sorted(chunk.named_parameters()):
            if getattr(p, "tensor_model_parallel", False):
                continue
            copies = [torch.empty_like(p) for _ in range(state.dims.tp)]
            dist.all_gather(copies, p.detach().contiguous(), group=state.tp_group)
            bad += sum(not torch.equal(copies[0], c) for c in copies[1:])
    return bad


# ----------------------------------------------------------------------------------------------- cases

def case_hf(model_dir, state, tmp):
    from transformers import AutoModelForCausalLM

    batch = make_batch(tokenizer_vocab(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits  # (B, P+R, V)
    z = logits[:, P - 1:-1].double() / TEMPERATURE  # (B, R, V): the outputs that predict the response tokens
    logp = torch.log_softmax(z, -1)
    m = batch["response_mask"].double()
    lp = logp.gather(-1, batch["responses"][..., None])[..., 0] * m
    ent = -(logp.exp() * logp).sum(-1) * m
    return {"log_probs": lp.tolist(), "entropy": ent.tolist(), "response_mask": batch["response_mask"].tolist()}


def case_layout(model_dir, state, tmp):
    batch = make_batch(tokenizer_vocab(model_dir))
    engine = build(state, model_dir, actor_config())
    lp, ent = engine.compute_log_probs(batch)
    engine.cfg.use_remove_padding = False
    lp_padded, _ = engine.compute_log_probs(batch)
    engine.cfg.use_remove_padding, engine.cfg.forward_use_dynamic_bsz, engine.cfg.forward_max_token_len = True, True, 30
    lp_dynamic, _ = engine.compute_log_probs(batch)
    engine.cfg.forward_use_dynamic_bsz = None
    shared = {}
    if state.dims.pp == 1:  # shared-prompt packing (no pipeline parallelism): rows 0-3 and 4-7 share a prompt
        grouped = {k: v.clone() for k, v in batch.items()}
        for first in (0, 4):
            for col in ("input_ids", "attention_mask"):
                grouped[col][first + 1:first + 4, :P] = grouped[col][first, :P]
        grouped["position_ids"] = (grouped["attention_mask"].cumsum(1) - 1).clamp(min=0)
        shared["log_probs_grouped"] = engine.compute_log_probs(grouped)[0].tolist()
        engine.cfg.share_prompt_prefix = True
        shared["log_probs_grouped_shared"] = engine.compute_log_probs(grouped)[0].tolist()
        engine.cfg.share_prompt_prefix = False
    ref_engine = build(state, model_dir, actor_config(role="ref"), role="ref")
    lp_ref, ent_ref = ref_engine.compute_log_probs(batch)
    del ref_engine

    ppo = dp_share(add_ppo_fields(batch, lp), state)
    # one mini-batch (the global batch) per epoch, 2 epochs: 2 optimizer steps per update. Smaller
    # mini-batches would hold different rows at different DP sizes (DP shards the batch first).
    engine.cfg.ppo_epochs = 2
    loss_before = engine.forward_backward(ppo)[0]  # the whole batch's loss (a probe: no optimizer step)
    metrics = [engine.update_policy(ppo) for _ in range(2)]
    loss_after = engine.forward_backward(ppo)[0]
    lp_after, _ = engine.compute_log_probs(batch)
    weights = exported(engine)
    return {"log_probs": lp.tolist(), "entropy": ent.tolist(), "log_probs_padded": lp_padded.tolist(),
            "log_probs_dynamic": lp_dynamic.tolist(), "ref_log_probs": lp_ref.tolist(),
            "ref_entropy_is_none": ent_ref is None, "metrics": metrics, "log_probs_after": lp_after.tolist(),
            "loss_before": loss_before, "loss_after": loss_after,
            "tp_mismatched_params": tp_replicas_equal(engine, state), **shared}, {"weights": weights}


def _grads(engine) -> dict:
    return {n: p.main_grad.detach().clone() for c in engine.chunks for n, p in c.named_parameters()}


def _params(engine) -> dict:
    return {n: p.detach().clone() for c in engine.chunks for n, p in c.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _max_abs(a: dict) -> float:
    return max(float(v.abs().max()) for v in a.values())


def case_grads(model_dir, state, tmp):
    batch = make_batch(tokenizer_vocab(model_dir))
    probe = build(state, model_dir, actor_config(role="ref"), role="ref")
    lp, _ = probe.compute_log_probs(batch)
    del probe
    ppo = add_ppo_fields(batch, lp)
    out = {}
    # packed vs padded: same loss, same gradients (and nonzero ones)
    grads = {}
    for packed in (True, False):
        engine = build(state, model_dir, actor_config(use_remove_padding=packed, micro_batch_size=4))
        metrics, _ = engine.forward_backward(ppo)
        grads[packed] = _grads(engine)
        out[f"loss_packed={packed}"] = metrics["loss"]
    out["packed_vs_padded_grad_diff"] = _max_diff(grads[True], grads[False])
    out["grad_max_abs"] = _max_abs(grads[True])
    # gradient accumulation: 1 micro-batch of 8, 8 of 1, token-budget micro-batches; then the optimizer step
    variants = {"1x8": dict(micro_batch_size=8), "8x1": dict(micro_batch_size=1),
                "dynamic": dict(use_dynamic_bsz=True, max_token_len=24)}
    grads, params, metrics = {}, {}, {}
    for name, kw in variants.items():
        for agg in ("token-mean", "seq-mean-token-mean"):
            engine = build(state, model_dir, actor_config(loss_agg_mode=agg, **kw))
            m = engine.update_policy(ppo)
            key = f"{name}/{agg}"
            grads[key], params[key], metrics[key] = _grads(engine), _params(engine), m
    for agg in ("token-mean", "seq-mean-token-mean"):
        for name in ("8x1", "dynamic"):
            out[f"grad_diff/{name}/{agg}"] = _max_diff(grads[f"1x8/{agg}"], grads[f"{name}/{agg}"])
            out[f"param_diff/{name}/{agg}"] = _max_diff(params[f"1x8/{agg}"], params[f"{name}/{agg}"])
            out[f"loss/{name}/{agg}"] = metrics[f"{name}/{agg}"]["actor/loss"]
        out[f"loss/1x8/{agg}"] = metrics[f"1x8/{agg}"]["actor/loss"]
    out["dynamic_micro_batches"] = metrics["dynamic/token-mean"]["actor/num_micro_batches"]
    return out


def case_offload(model_dir, state, tmp):
    batch = make_batch(tokenizer_vocab(model_dir))
    runs = {}
    out = {}
    for mode in ("plain", "offload"):
        engine = build(state, model_dir, actor_config(mini_batch_size=4))
        lp, _ = engine.compute_log_probs(batch)
        ppo = dp_share(add_ppo_fields(batch, lp), state)
        m1 = engine.update_policy(ppo)
        if mode == "offload":
            moved = engine.offload(params=True, grads=True, optimizer=True)
            out["moved"] = moved
            out["params_released"] = all(p.untyped_storage().nbytes() == 0
                                         for c in engine.chunks for p in c.parameters())
            try:
                engine.compute_log_probs(batch)
                out["refused_while_offloaded"] = False
            except RuntimeError:
                out["refused_while_offloaded"] = True
            out["restored"] = engine.onload()
        m2 = engine.update_policy(ppo)
        runs[mode] = (_params(engine), m1, m2)
    plain, off = runs["plain"], runs["offload"]
    out["params_bitwise_equal"] = all(torch.equal(plain[0][k], off[0][k]) for k in plain[0])
    out["metrics_equal"] = plain[2] == off[2] or all(
        plain[2][k] == off[2][k] for k in plain[2] if not k.startswith("perf/"))
    return out


def case_critic(model_dir, state, tmp):
    from rlhf_mcore.engine import EngineConfig

    batch = make_batch(tokenizer_vocab(model_dir))
    cfg = EngineConfig(role="critic", micro_batch_size=4, cliprange_value=100.0)
    engine = build(state, model_dir, cfg, role="critic", lr=1e-2)
    mask = batch["response_mask"].float()
    target = 0.5
    first = None
    for _ in range(12):
        values = engine.compute_values(batch)
        first = values if first is None else first
        m = engine.update_critic({**batch, "values": values, "returns": torch.full_like(mask, target) * mask})
    values = engine.compute_values(batch)
    err = ((values - target).abs() * mask).sum() / mask.sum()
    err0 = ((first - target).abs() * mask).sum() / mask.sum()
    return {"initial_error": float(err0), "final_error": float(err), "last_vf_loss": m["critic/vf_loss"],
            "values_zero_on_padding": bool((values * (1 - mask)).abs().max() == 0),
            "flop_head_width": engine.flop_shape.vocab_size, "vocab_size": engine.vocab_size}


def case_ckpt(model_dir, state, tmp):
    from rlhf_mcore.parallel import init_distributed

    batch = make_batch(tokenizer_vocab(model_dir))
    ckpt_dir = Path(tmp) / "ckpt_engine"
    engine = build(state, model_dir, actor_config())
    lp, _ = engine.compute_log_probs(batch)
    ppo_full = add_ppo_fields(batch, lp)
    engine.update_policy(dp_share(ppo_full, state))
    lp_saved, _ = engine.compute_log_probs(batch)
    engine.save_checkpoint(ckpt_dir, extra={"note": "engine test"})
    m_continued = engine.update_policy(dp_share(ppo_full, state))
    continued = exported(engine)
    saved_layout = [state.dims.tp, state.dims.pp, state.dims.dp]
    del engine
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    state = init_distributed(tp=1, pp=1, seed=99)  # a different layout, a different seed
    engine = build(state, model_dir, actor_config(), load=False)
    extra = engine.load_checkpoint(ckpt_dir)
    lp_loaded, _ = engine.compute_log_probs(batch)
    m_resumed = engine.update_policy(dp_share(ppo_full, state))
    resumed = exported(engine)
    diff = max(float((continued[k] - resumed[k]).abs().max()) for k in continued)
    return {"saved_layout": saved_layout, "loaded_layout": [state.dims.tp, state.dims.pp, state.dims.dp],
            "log_prob_diff": float((lp_saved - lp_loaded).abs().max()), "extra": extra,
            "global_steps": engine.global_steps, "next_update_weight_diff": diff,
            "grad_norm_continued": m_continued["actor/grad_norm"], "grad_norm_resumed": m_resumed["actor/grad_norm"]}


def _naive_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float):
    """Full-softmax reference over the real vocabulary (padding columns dropped), fp64."""
    z = logits[:, :vocab].double() / temperature  # (N, V)
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def case_logprob_tp(model_dir, state, tmp):
    from rlhf_mcore.kernels.logprob_reference import vocab_parallel_logprobs

    tp, rank = state.dims.tp, state.tp_rank
    errors = {}
    # (rows, real vocab, padded vocab, temperature, chunk, score a subset of rows); at TP=2 the last case
    # leaves rank 1 with padding columns only
    for n, vocab, padded, temp, chunk, subset in [(13, 37, 40, 1.0, 4, False), (11, 50, 64, 0.7, 3, True),
                                                  (6, 20, 20, 1.3, 64, True), (5, 30, 64, 1.0, 2, False)]:
        g = torch.Generator().manual_seed(n * 1000 + vocab)
        full = (3 * torch.randn(n, padded, generator=g)).requires_grad_(True)  # (N, Vp) the same on every rank
        rows = torch.randperm(n, generator=g)[: n // 2] if subset else torch.arange(n)  # (M,)
        labels = torch.randint(0, vocab, (rows.numel(),), generator=g)  # (M,)
        w_lp, w_ent = torch.randn(rows.numel(), generator=g), torch.randn(rows.numel(), generator=g)
        v_local = padded // tp
        shard = full.detach()[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(shard, labels, rows=rows if subset else None, tp_group=state.tp_group,
                                          temperature=temp, vocab_size=vocab, chunk_size=chunk)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        ref_lp, ref_ent = _naive_logprobs(full[rows], labels, vocab, temp)
        ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
        ref_grad = full.grad[:, rank * v_local:(rank + 1) * v_local]
        errors[f"n{n}_v{vocab}_p{padded}_t{temp}"] = {
            "log_prob": float((lp.detach().double() - ref_lp.detach()).abs().max()),
            "entropy": float((ent.detach().double() - ref_ent.detach()).abs().max()),
            "grad": float((shard.grad.double() - ref_grad.double()).abs().max()),
            "grad_scale": float(ref_grad.abs().max())}
    per_rank = [None] * state.world_size
    dist.all_gather_object(per_rank, errors)
    return {"tp": tp, "per_rank": per_rank}


def case_fp8(model_dir, state, tmp):
    """One PPO update with the decoder linears in FP8 (fp8=hybrid, each recipe) and without: loss and global
    gradient norm. On the CPU the FP8 GEMMs are the dequantized fp32 reference, so the device check is patched out;
    at TP=2 each rank quantizes its own shards (and the input gradient of a column-parallel layer is all-reduced by
    the FP8 linear itself). Its own model: the shared one's init (std 0.2, chaotic on purpose for token-level
    tests) turns FP8's rounding into whole nats; at transformers' 0.02 it stays at FP8's size. Rank 0 writes it
    (transformers saves on the main process only), the others wait."""
    from rlhf_mcore.models import fp8_training
    from rlhf_mcore.models.tiny import make_tiny_model

    fp8_training.check_fp8_device = lambda device, key: None
    model_dir = Path(tmp) / "fp8_model"
    if dist.get_rank() == 0:
        make_tiny_model(model_dir, arch="qwen2", layers=4, init_std=0.02)
    dist.barrier()
    ppo = ppo_share(model_dir, state)
    out = {}
    for recipe in ("off", "rowwise", "tensorwise", "delayed", "delayed_two_linears"):
        engine = build(state, model_dir, actor_config(micro_batch_size=4))
        fp8_training.FUSE_SWIGLU_MLP = recipe != "delayed_two_linears"  # delayed: its MLPs as one Function each
        if recipe != "off":
            fp8_training.enable_fp8_training(engine.chunks, "hybrid", "fp8", recipe.split("_")[0])
        m = engine.update_policy(ppo)
        out[recipe] = {k: m[f"actor/{k}"] for k in ("grad_norm", "pg_loss", "loss")}
        out[recipe]["fused_mlps"] = getattr(engine.chunks[0], "fp8_fused_mlps", 0)
    return out


def case_fusion(model_dir, state, tmp):
    """One PPO update (micro-batches of 2) with `gradient_accumulation_fusion` (rlhf_mcore.models.grad_accum_fusion:
    each linear's weight gradient accumulated into main_grad by the GEMM) and without: loss and global gradient
    norm, for the layouts (TP shards, DP ranks, pipeline stages) to compare with one process's unfused update."""
    from rlhf_mcore.engine import TrainEngine
    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.grad_accum_fusion import install

    ppo = ppo_share(model_dir, state)
    out = {}
    for fused in (False, True):
        if fused:
            install()
        chunks = build_model(model_dir, state, role="actor",
                             config_overrides={"gradient_accumulation_fusion": True} if fused else None)
        engine = TrainEngine(chunks, state, actor_config(micro_batch_size=2), optim_config(1e-4))
        m = engine.update_policy(ppo)
        out["fused" if fused else "off"] = {k: m[f"actor/{k}"] for k in ("grad_norm", "pg_loss", "loss")}
    return out


def case_on_policy(model_dir, state, tmp):
    """Two shuffled mini-batches a rank and two epochs: the update after an old-log-prob pass against the update
    that takes the first mini-batch's old log-probs from its own forward (`on_policy`, Learner.old_from_update),
    whose batch holds garbage at those rows: loss, gradient norm, the old log-probs written back, the weights'
    largest difference (the layouts' grids and rows: DP shares, pipeline stages' broadcast, TP)."""
    share = ppo_share(model_dir, state)
    b = share["input_ids"].shape[0]
    cfg = actor_config(micro_batch_size=1, mini_batch_size=b // 2, shuffle=True, seed=3, ppo_epochs=2)
    engine = build(state, model_dir, cfg)
    lp, ent = engine.compute_log_probs(share)
    m_pass = engine.update_policy({**share, "old_log_probs": lp})
    after_pass = _params(engine)
    engine = build(state, model_dir, cfg)
    rows = engine.on_policy_rows(b)
    batch = {**share, "old_log_probs": lp.clone().index_fill_(0, rows, 5.0)}
    m_own = engine.update_policy(batch, on_policy=True)
    keys = ("grad_norm", "pg_loss", "loss")
    return {"pass": {k: m_pass[f"actor/{k}"] for k in keys}, "own": {k: m_own[f"actor/{k}"] for k in keys},
            "rows": rows.tolist(), "old_diff": float((batch["old_log_probs"] - lp).abs().max()),
            "entropy_diff": float((batch["old_entropy"] - ent)[rows].abs().max()),  # the batch had none elsewhere
            "param_diff": _max_diff(after_pass, _params(engine))}


def case_values_on_policy(model_dir, state, tmp):
    """The critic's counterpart of `case_on_policy` (Learner.values_from_update): two shuffled mini-batches a rank,
    two epochs, a small value clip (the loss reads the old values), the update after a values pass against the
    update that takes its first mini-batch's values from its own forward, whose batch holds garbage at those rows:
    loss, gradient norm, the values written back, the weights' largest difference."""
    from rlhf_mcore.engine import EngineConfig

    share = dp_share(make_batch(tokenizer_vocab(model_dir)), state)
    b = share["input_ids"].shape[0]
    mask = share["response_mask"].float()
    share["returns"] = torch.linspace(-1, 1, mask.shape[1]).expand_as(mask) * mask
    cfg = EngineConfig(role="critic", micro_batch_size=1, mini_batch_size=b // 2, shuffle=True, seed=3, ppo_epochs=2,
                       cliprange_value=0.002)
    engine = build(state, model_dir, cfg, role="critic", lr=1e-2)
    values = engine.compute_values(share)
    m_pass = engine.update_critic({**share, "values": values})
    after_pass = _params(engine)
    engine = build(state, model_dir, cfg, role="critic", lr=1e-2)
    rows = engine.on_policy_rows(b)
    batch = {**share, "values": values.clone().index_fill_(0, rows, 5.0)}
    m_own = engine.update_critic(batch, on_policy=True)
    keys = ("grad_norm", "vf_loss", "vf_clipfrac", "loss")
    return {"pass": {k: m_pass[f"critic/{k}"] for k in keys}, "own": {k: m_own[f"critic/{k}"] for k in keys},
            "rows": rows.tolist(), "values_diff": float((batch["values"] - values).abs().max()),
            "param_diff": _max_diff(after_pass, _params(engine))}


CASES = {"hf": case_hf, "layout": case_layout, "grads": case_grads, "offload": case_offload, "critic": case_critic,
         "ckpt": case_ckpt, "logprob_tp": case_logprob_tp, "fp8": case_fp8, "fusion": case_fusion,
         "on_policy": case_on_policy, "values_on_policy": case_values_on_policy}


def parse_layout(text: str):
    tp, rest = text.split("x")
    pp, _, vpp = rest.partition("v")
    return int(tp), int(pp), (int(vpp) if vpp else None)


def main():
    from rlhf_mcore.startup import pause_gc

    pause_gc()  # the worker's start-up without the cyclic collector, as the launch scripts' (rlhf_mcore/startup.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu

    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    out = Path(args.out)
    results = {}
    for spec in args.cases.split(","):
        name, _, layout = spec.partition("@")
        tp, pp, vpp = parse_layout(layout or "1x1")
        start = time.perf_counter()
        state = init_distributed(tp=tp, pp=pp, vpp=vpp, seed=7)
        ret = CASES[name](args.model, state, out)
        tensors = None
        if isinstance(ret, tuple):
            ret, tensors = ret
        results[spec] = {**ret, "seconds": time.perf_counter() - start}
        if tensors is not None and dist.get_rank() == 0:
            torch.save(tensors, out / f"{spec.replace('@', '_')}.pt")
        mpu.destroy_model_parallel()
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main()
