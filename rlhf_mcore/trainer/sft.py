"""Supervised fine-tuning on the train engine (response-only loss), for warm starts before RL.

It is the actor engine with the ``sft`` policy loss (negative log-likelihood of the response tokens): the same
model building, parallel layout, micro-batching, optimizer and Hugging Face export as RL training. Targets
come from veRL-schema parquet rows: ``extra_info.answer`` (GSM8K-style worked solutions; the synthetic task
writes them too) or a top-level ``response`` column, followed by the tokenizer's end-of-turn token.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf_mcore.config import ConfigError, load_config
from rlhf_mcore.data import DataError
from rlhf_mcore.parallel import destroy_distributed, init_distributed
from rlhf_mcore.trainer.batch import build_batch
from rlhf_mcore.trainer.logging import reduce_metrics
from rlhf_mcore.trainer.run_lock import take_run_lock


def _target(row: dict[str, Any], row_no: int, path: str) -> str:
    if isinstance(row.get("response"), str):
        return row["response"]
    extra = row.get("extra_info") or {}
    if isinstance(extra, dict) and isinstance(extra.get("answer"), str):
        return extra["answer"]
    raise DataError(f"{path}, row {row_no}: no SFT target: give a 'response' string column or "
                     f"extra_info.answer (as preprocess_data.py writes).")


def load_sft_rows(path: str, tokenizer, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with the chat template, response ids ending in the end-of-turn token); too long rows dropped."""
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise FileNotFoundError(f"--train-file {path!r} does not exist")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    end = tokenizer.eos_token_id if end is None or end == tokenizer.unk_token_id else end
    rows = []
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            raise DataError(f"{path}, row {i}: 'prompt' must be a list of chat messages")
        p = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        p = p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p)
        r = tokenizer(_target(row, i, path), add_special_tokens=False)["input_ids"] + [end]
        if len(p) + len(r) <= max_length:
            rows.append((list(p), r))
    if not rows:
        raise DataError(f"no row of {path} fits --max-length {max_length}")
    return rows


def run_sft(model: str, train_file: str, out: str, *, steps: int, batch_size: int, lr: float, max_length: int,
            tp: int = 1, pp: int = 1, seed: int = 1, warmup_steps: int = 0, log_every: int = 10,
            overrides: Optional[list[str]] = None) -> dict[str, float]:
    from transformers import AutoTokenizer

    from rlhf_mcore.data import ResumableSampler
    from rlhf_mcore.engine import build_engine

    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {model!r} is not a Hugging Face model directory (no config.json)")
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={warmup_steps}",
        "actor_rollout_ref.actor.optim.lr_scheduler=cosine", "actor_rollout_ref.actor.policy_loss=sft",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}", f"data.train_batch_size={batch_size}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_length * 8}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}", f"trainer.seed={seed}",
        *(overrides or [])])
    state = init_distributed(tp, pp, device=cfg.trainer.device, seed=seed)
    lock = take_run_lock(out, state, key="--out")  # one live SFT run per output directory
    try:
        if batch_size % state.dims.dp:
            raise ConfigError(f"--batch-size {batch_size} must be divisible by the data-parallel size {state.dims.dp}")
        tok = AutoTokenizer.from_pretrained(model)
        rows = load_sft_rows(train_file, tok, max_length)
        engine = build_engine(cfg, state, role="actor", total_steps=steps)
        sampler = ResumableSampler(len(rows), shuffle=True, seed=seed)
        per_rank = batch_size // state.dims.dp
        t0, last = time.time(), {}
        for step in range(1, steps + 1):
            ids = sampler.next_batch(batch_size)[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]
            prompts, responses = [rows[i][0] for i in ids], [rows[i][1] for i in ids]
            batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], ["stop"] * len(ids),
                                list(ids), {}, pad_token_id=tok.pad_token_id or 0)
            batch["old_log_probs"] = torch.zeros_like(batch["rollout_log_probs"])  # unused by the sft loss
            batch["advantages"] = batch["response_mask"].float()
            last = reduce_metrics(engine.update_policy(batch))
            if state.is_coordinator and (step % log_every == 0 or step == steps):
                print(f"sft step {step}/{steps} | loss {last.get('actor/pg_loss', float('nan')):.4f} | "
                      f"lr {last.get('actor/lr', 0):.2e} | {time.time() - t0:.0f}s", flush=True)
        engine.save_hf(out)
        if state.is_coordinator:
            print(f"SFT model (Hugging Face format): {out}", flush=True)
        return last
    finally:
        destroy_distributed()
        lock.release()
