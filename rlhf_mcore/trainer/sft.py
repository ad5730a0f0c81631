"""Supervised fine-tuning on the train engine (response-only loss), for warm starts before RL.

It is the actor engine with the ``sft`` policy loss (negative log-likelihood of the response tokens): the same
model building, parallel layout, micro-batching, optimizer and Hugging Face export as RL training. Targets
come from veRL-schema parquet rows: ``extra_info.answer`` (GSM8K-style worked solutions; the synthetic task
writes them too) or a top-level ``response`` column, followed by the tokenizer's end-of-turn token.

Multi-turn targets: ``extra_info.messages``, the conversation after the prompt (assistant turns, and the tool /
user messages between them). They are tokenized as multi-turn rollouts are (rlhf_mcore.agents.trajectory: each
assistant turn is its text and the end-of-turn token, each message between turns what the chat template adds for
it), and the loss is on the assistant turns only (the response mask is 0 on the messages between them).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf_mcore.config import ConfigError, load_config
from rlhf_mcore.config.cross import check_moe_tensor_parallel
from rlhf_mcore.data import DataError
from rlhf_mcore.data.batch import build_batch
from rlhf_mcore.parallel import destroy_distributed, init_distributed
from rlhf_mcore.parallel.allocator import expandable_segments_for
from rlhf_mcore.trainer.logging import reduce_metrics
from rlhf_mcore.trainer.run_lock import take_run_lock


def _target(row: dict[str, Any], row_no: int, path: str) -> str | list[dict]:
    """The row's target: a string, or (extra_info.messages) the messages of a multi-turn target."""
    if isinstance(row.get("response"), str):
        return row["response"]
    extra = row.get("extra_info") or {}
    if isinstance(extra, dict) and extra.get("messages") is not None:
        msgs = extra["messages"]
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                        and isinstance(m.get("content"), str) for m in msgs)
                and msgs[0]["role"] == "assistant" and msgs[-1]["role"] == "assistant"):
            raise DataError(f"{path}, row {row_no}: extra_info.messages must be a list of {{'role', 'content'}} "
                            f"messages that starts and ends with an assistant turn (got {msgs!r:.200}).")
        return [{k: v for k, v in m.items() if v is not None} for m in msgs]  # parquet fills absent keys with null
    if isinstance(extra, dict) and isinstance(extra.get("answer"), str):
        return extra["answer"]
    raise DataError(f"{path}, row {row_no}: no SFT target: give a 'response' string column, "
                     f"extra_info.messages (multi-turn) or extra_info.answer (as preprocess_data.py writes).")


def _multi_turn_target(tokenizer, prompt: list[dict], prompt_ids: list[int], msgs: list[dict], end: int,
                       budget: int, tools: Optional[list[dict]]) -> Optional[tuple[list[int], list[int]]]:
    """(response ids, loss mask) of a multi-turn target, tokenized as a rollout would produce it; None when it
    does not fit in `budget` tokens."""
    from rlhf_mcore.agents.trajectory import TrajectoryBuilder

    traj = TrajectoryBuilder(tokenizer, prompt, prompt_ids, max_response_tokens=budget, tools=tools,
                             stop_token_ids=(end,))
    k = 0
    while k < len(msgs):
        if msgs[k]["role"] == "assistant":
            ids = tokenizer(msgs[k]["content"], add_special_tokens=False)["input_ids"] + [end]
            traj.add_model_turn(ids, [0.0] * len(ids), "stop")
            k += 1
        else:  # the messages up to the next assistant turn, as one turn (templates group tool results)
            j = next(i for i in range(k, len(msgs)) if msgs[i]["role"] == "assistant")
            if traj.done or not traj.add_messages(msgs[k:j], role=msgs[k]["role"]):  # done: the budget is spent
                return None
            k = j
    if len(traj.response_ids) > budget:
        return None
    return traj.response_ids, traj.response_mask


def end_of_turn_id(tokenizer) -> int:
    """The special token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>, ...): the first
    token after an assistant message's text; the tokenizer's eos token when the template writes none."""
    probe = "Done."
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."},
                                              {"role": "assistant", "content": probe}], tokenize=False)
        after = tokenizer(text[text.rindex(probe) + len(probe):], add_special_tokens=False)["input_ids"]
    except Exception:  # no chat template, or one that rejects this conversation
        after = []
    if after and after[0] in set(tokenizer.all_special_ids):
        return int(after[0])
    return tokenizer.eos_token_id


def load_sft_rows(path: str, tokenizer, max_length: int,
                  tools: Optional[list[dict]] = None) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids with the chat template, response ids ending in the end-of-turn token, loss mask); too long
    rows dropped. `tools`: the tool schemas the chat template lists (as the RL run's multi_turn.tool_config_path)."""
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise FileNotFoundError(f"--train-file {path!r} does not exist")
    end = end_of_turn_id(tokenizer)
    kw = {"tools": tools} if tools else {}
    rows = []
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            raise DataError(f"{path}, row {i}: 'prompt' must be a list of chat messages")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kw)
        p = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # as the RL dataset tokenizes prompts
        target = _target(row, i, path)
        if isinstance(target, list):
            rm = _multi_turn_target(tokenizer, prompt, p, target, end, max_length - len(p), tools)
            if rm is not None:
                rows.append((p, *rm))
            continue
        r = tokenizer(target, add_special_tokens=False)["input_ids"] + [end]
        if len(p) + len(r) <= max_length:
            rows.append((p, r, [1] * len(r)))
    if not rows:
        raise DataError(f"no row of {path} fits --max-length {max_length}")
    return rows


def run_sft(model: str, train_file: str, out: str, *, steps: int, batch_size: int, lr: float, max_length: int,
            tp: int = 1, pp: int = 1, seed: int = 1, warmup_steps: int = 0, log_every: int = 10,
            overrides: Optional[list[str]] = None, tool_config: Optional[str] = None) -> dict[str, float]:
    """`tool_config`: a tool config YAML (as multi_turn.tool_config_path) whose schemas the prompts list."""
    from rlhf_mcore.data import ResumableSampler
    from rlhf_mcore.engine import build_engine
    from rlhf_mcore.models.tokenizer import load_tokenizer

    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {model!r} is not a Hugging Face model directory (no config.json)")
    tok = load_tokenizer(model, "--model")  # before any process group: a directory without a tokenizer is refused
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
    check_moe_tensor_parallel(cfg, tp)  # before any process group: megatron-core's own error comes at the first step
    state = init_distributed(tp, pp, device=cfg.trainer.device, seed=seed,
                             expandable_segments=expandable_segments_for(cfg))
    lock = take_run_lock(out, state, key="--out")  # one live SFT run per output directory
    try:
        if batch_size % state.dims.dp:
            raise ConfigError(f"--batch-size {batch_size} must be divisible by the data-parallel size {state.dims.dp}")
        tools = None
        if tool_config:
            from rlhf_mcore.agents import load_tool_config

            tools = [t.schema() for t in load_tool_config(tool_config).values()] or None
        rows = load_sft_rows(train_file, tok, max_length, tools)
        engine = build_engine(cfg, state, role="actor", total_steps=steps)
        sampler = ResumableSampler(len(rows), shuffle=True, seed=seed)
        per_rank = batch_size // state.dims.dp
        t0, last = time.time(), {}
        for step in range(1, steps + 1):
            ids = sampler.next_batch(batch_size)[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]
            prompts, responses = [rows[i][0] for i in ids], [rows[i][1] for i in ids]
            batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], ["stop"] * len(ids),
                                list(ids), {}, pad_token_id=tok.pad_token_id or 0,
                                response_masks=[rows[i][2] for i in ids])
            batch["old_log_probs"] = torch.zeros_like(batch["rollout_log_probs"])  # unused by the sft loss
            batch["advantages"] = batch["response_mask"].float()  # the loss: assistant tokens only
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
