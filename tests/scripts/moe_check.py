"""Worker for tests/test_moe.py, run under torchrun with 4 processes (several layouts inside one process group).

For every layout of the spec (tp, pp, ep) and tiny MoE model it builds the Megatron chunks from the HF directory
(the loader a user's directory goes through) and
- runs Megatron's schedule forward-only on the documents (a plain batch, a left-padded one with a mask, the
  documents packed as THD) and saves the gathered logits for pytest to compare with transformers;
- exports HF tensors with `export_hf_weights` and compares them bitwise with the checkpoint, on every rank;
- per layout "readlog": loads again with a ReadLog and reports which experts each rank read;
- per layout "save_hf": writes an HF directory with `save_hf_checkpoint` (pytest compares it bitwise);
- per layout "load_mcore": loads a Megatron checkpoint saved under another layout, exports it bitwise, and
  converts it to HF (`convert_checkpoint.mcore_to_hf`);
- per layout "replay": routing replay R3 through the train engine and the learner against flipped routing
  (`replay_check`; tests/test_moe_replay.py does the same in one process, with the native engine's routes);
- per layout "aux": one training forward with the load-balancing and z-losses on, their logged values
  (`moe.moe_loss_metrics`) and the same losses computed by hand from the routers' inputs.

Usage: torchrun --nproc_per_node=4 tests/scripts/moe_check.py --spec SPEC.json --out DIR
"""
import re
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from models_check import documents, from_mcore, gather_problems, packed_batch, padded_batch, roundtrip, run_forward
from models_check import main as run_spec

from rlhf_mcore.parallel import init_distributed

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")


def reporter(state) -> bool:
    return state.is_last_stage and state.tp_rank == 0 and state.dp_rank == 0


def experts_read(log) -> list:
    """The global expert indices whose weights a ReadLog saw."""
    return sorted({int(m.group(1)) for name, _ in log.reads for m in [_EXPERT.search(name)] if m})


def naive_router_losses(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> tuple[float, float]:
    """Megatron's load-balancing loss (its docstring's formula) and z-loss of one router, by hand: x (T, H)."""
    logits = x.float() @ weight.float().T  # (T, E)
    probs = torch.softmax(logits, dim=-1)
    n_tokens, n_experts = logits.shape
    counts = torch.zeros(n_experts)
    for row in probs.topk(top_k, dim=-1).indices:
        for e in row.tolist():
            counts[e] += 1
    f = counts / (n_tokens * top_k)  # the fraction of routed slots each expert got
    p = probs.sum(0) / n_tokens  # each expert's mean probability
    return float(n_experts * (f * p).sum()), float((torch.logsumexp(logits, dim=-1) ** 2).mean())


def aux_losses(hf_dir, state, ids, pos) -> dict:
    """One training forward with both MoE losses on: what `moe_loss_metrics` logs and the naive values."""
    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.moe import moe_loss_metrics

    chunks = build_model(hf_dir, state, config_overrides={"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 1e-3})
    model, seen = chunks[0], []
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    hooks = [r.register_forward_pre_hook(lambda m, args: seen.append((m, args[0].reshape(-1, args[0].shape[-1]))))
             for r in routers]
    model.train()
    model(ids, pos, None).sum().backward()
    for h in hooks:
        h.remove()
    naive = [naive_router_losses(x.detach(), m.weight.detach(), m.topk) for m, x in seen]
    logged = moe_loss_metrics(state, "actor", micro_batches=1)
    again = moe_loss_metrics(state, "actor", micro_batches=1)  # the tracker was cleared: nothing new to log
    return {"logged": logged, "again": again,
            "naive": {"actor/moe_load_balancing_loss": sum(a for a, _ in naive) / len(naive),
                      "actor/moe_z_loss": sum(z for _, z in naive) / len(naive)}}


@contextmanager
def flipped_routing(*engines):
    """Every router of the engines' chunks gets +50 on the logit of the first expert outside each token's own top-k:
    every token's routes flip, while the logits of the experts it routed to stay as they were (so a pass replaying
    the unperturbed routes of a Qwen3-MoE model computes exactly what the unperturbed model does)."""
    from rlhf_mcore.models.routing_replay import chunk_routers

    routers = [r for e in engines for c in e.chunks for _, r in chunk_routers(c)]

    def flip(gating, k):
        def gate(x):
            logits = gating(x)  # (S, B, E)
            top = logits.topk(k, dim=-1).indices
            outside = torch.ones_like(logits, dtype=torch.bool).scatter(-1, top, False)
            return logits + 50.0 * torch.nn.functional.one_hot(outside.float().argmax(-1), logits.shape[-1])
        return gate

    for r in routers:
        r.gating = flip(r.gating, r.topk)
    try:
        yield
    finally:
        for r in routers:
            del r.gating  # back to the class's method


def replay_check(hf_dir, state, docs) -> dict:
    """R3 at this layout: a batch whose rows carry transformers' routes (what the native engine records: its equality
    is tests/test_moe_rollout.py's) and log-probs as the rollout's; each rank its own rows (EP: tokens cross ranks).
    With routing flipped, the learner's old-log-prob pass (replaying) gives transformers' log-probs and sees every
    token's routes flipped; the engine without replay does not. Returns the largest gaps over ranks."""
    import transformers

    from rlhf_mcore.config import load_config
    from rlhf_mcore.data.batch import build_batch
    from rlhf_mcore.trainer import roles
    from rlhf_mcore.trainer.learner import Learner

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k = hf.config.num_experts_per_tok
    mine = docs[state.dp_rank:] + docs[:state.dp_rank]  # another order (and shapes) on each DP rank
    prompts, responses, logprobs, routes = [], [], [], []
    for d in mine:
        with torch.no_grad():
            out = hf(d[None], output_router_logits=True)
        lp = torch.log_softmax(out.logits[0].float(), -1)[:-1].gather(-1, d[1:, None])[:, 0]  # (n - 1,)
        prompts.append(d[:4].tolist())
        responses.append(d[4:].tolist())
        logprobs.append(lp[3:].tolist())
        routes.append(torch.stack([lg.topk(k, -1).indices for lg in out.router_logits], 1)[:-1].to(torch.uint8))
    batch = build_batch(prompts, responses, logprobs, ["stop"] * len(mine), list(range(len(mine))), {},
                        pad_token_id=0, routes=routes)
    n = len(mine) * state.dims.dp
    cfg = load_config(None, [f"actor_rollout_ref.model.path={hf_dir}", "trainer.device=cpu",
                             f"data.train_batch_size={n}", "actor_rollout_ref.rollout.n=1",
                             f"actor_rollout_ref.actor.ppo_mini_batch_size={n}",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                             "actor_rollout_ref.actor.router_replay.mode=R3"])
    actor = roles.build_actor(cfg, state, total_steps=1)
    want, mask = batch["rollout_log_probs"], batch["response_mask"]
    with flipped_routing(actor):
        b = dict(batch)
        metrics = Learner(cfg, state, actor).forward_passes(b)
        saved = actor.cfg
        actor.cfg = replace(saved, router_replay="disabled")
        plain, _ = actor.compute_log_probs(batch)
        actor.cfg = saved
    gaps = torch.tensor([float(((b["old_log_probs"] - want).abs() * mask).max()),
                         -float(((plain - want).abs() * mask).max())])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    return {"r3_vs_hf": gaps[0].item(), "plain_vs_hf": -gaps[1].item(),
            "mismatch": metrics["actor/moe_routing_mismatch/mean"], "load": metrics["actor/moe_expert_load/mean"]}


def run_layout(layout, spec, out: Path, results: dict):
    from megatron.core import parallel_state as mpu

    from rlhf_mcore.models import build_model, load_hf_weights, save_hf_checkpoint
    from rlhf_mcore.models.hf_loader import ReadLog

    name = layout["name"]
    state = init_distributed(tp=layout["tp"], pp=layout["pp"], ep=layout.get("ep", 1), seed=3)
    docs = documents(spec)
    res = results.setdefault(name, {})
    for model_name in layout["models"]:
        hf_dir = spec["models"][model_name]
        chunks = build_model(hf_dir, state, role="actor")
        for c in chunks:  # as the engine scores: megatron-core's MoE layer refuses a training forward at TP > 1
            c.eval()  # without sequence parallelism
        res[f"{model_name}/roundtrip"] = gather_problems(state, roundtrip(chunks, state, hf_dir))
        cases = {"plain": padded_batch([docs[0], docs[2]], left=True), "left_padded": padded_batch(docs, left=True)}
        for case, (ids, pos, mask) in cases.items():
            logits = run_forward(chunks, state, ids, pos, mask, None)
            if reporter(state):
                torch.save({"logits": logits, "mask": mask}, out / f"{name}_{model_name}_{case}.pt")
        ids, pos, psp = packed_batch(docs)
        logits = run_forward(chunks, state, ids, pos, None, psp)
        if reporter(state):
            torch.save({"logits": logits, "cu": psp.cu_seqlens_q}, out / f"{name}_{model_name}_thd.pt")
        if model_name in layout.get("readlog", []):
            log = ReadLog()
            load_hf_weights(chunks, hf_dir, state, read_log=log)
            everyone = [None] * state.world_size
            dist.all_gather_object(everyone, {"ep_rank": state.ep_rank, "experts": experts_read(log)})
            res[f"{model_name}/experts_read"] = everyone
        if model_name in layout.get("aux", []):
            ids, pos, _ = cases["plain"]
            res[f"{model_name}/aux"] = aux_losses(hf_dir, state, ids, pos)
        if model_name in layout.get("replay", []):
            res[f"{model_name}/replay"] = replay_check(hf_dir, state, docs)
        if model_name in layout.get("save_hf", []):
            save_hf_checkpoint(chunks, state, out / f"{name}_{model_name}_hf", hf_dir, max_shard_bytes=40_000)
        del chunks
    for model_name, mcore_dir in layout.get("load_mcore", {}).items():  # saved under another layout
        res[f"{model_name}/from_mcore_roundtrip"] = from_mcore(state, mcore_dir, spec["models"][model_name],
                                                               out / f"{name}_{model_name}_from_mcore_hf")
    mpu.destroy_model_parallel()


if __name__ == "__main__":
    run_spec(run_layout)
