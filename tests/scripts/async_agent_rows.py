"""Worker for tests/test_agent_trainer.py: launch/train.py's asynchronous run with an observer on the training pool
(one training rank) that writes, per step, every trained row as it came over the data bus and the step's metrics,
saves the actor's weights after each step (the policy version the rollout pool receives) and, after step 1, creates
the file `DIR/gate` (the test's gated calculator holds later tool calls until it exists).

Usage: torchrun --nproc_per_node=2 tests/scripts/async_agent_rows.py --out DIR key=value ...

DIR/rows.jsonl: one line per trained row {"step", "ground_truth", "prompt_ids", "response_ids", "response_mask",
"logprobs" (the rollout's), "versions" (per response token)}, then {"step", "metrics"}; DIR/v{step}.pt: the weights
(Hugging Face names) of policy version `step`.
"""
import json
from pathlib import Path

import torch
from worker_common import run_async_trainer

from rlhf_mcore.trainer.hooks import StepHooks


class RowWriter(StepHooks):
    def __init__(self, out: str):
        self.out = Path(out)

    def step_end(self, parts, step, batch, metrics, timer) -> None:
        weights = {name: t.detach().clone() for name, t in parts.actor.export_hf_weights()}  # every training rank
        if not parts.state.is_coordinator:
            return
        torch.save(weights, self.out / f"v{step}.pt")
        with open(self.out / "rows.jsonl", "a") as f:
            for prompt, r in parts.rows:  # the step's rows as they came off the data bus
                f.write(json.dumps({"step": step, "ground_truth": parts.train_set[prompt]["ground_truth"],
                                    "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                                    "response_mask": r.response_mask, "logprobs": r.logprobs,
                                    "versions": r.versions}) + "\n")
            f.write(json.dumps({"step": step, "metrics": metrics}) + "\n")
        if step == 1:
            (self.out / "gate").touch()  # after the weight sync of step 1 (fit's push precedes step_end)


if __name__ == "__main__":
    run_async_trainer("--out", RowWriter)
