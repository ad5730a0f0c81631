"""Tool-use datasets in veRL's schema, with `agent_name: tool_agent`.

- `gsm8k_tool`: GSM8K rows (as `rlhf_mcore.data.preprocess`) whose prompt invites the calculator, as veRL's
  GSM8K multi-turn example; scored by the GSM8K reward (`openai/gsm8k`).
- `multiply`: "What is 483920 * 771245? Use the calculator. ..." with two 6-digit numbers (`digits`): a tiny
  model cannot multiply, so the reward needs the calculator. The SFT target `extra_info.messages` is the whole
  exchange: the model's call, the calculator's answer (a tool message) and the model's "#### N" (launch/sft.py
  puts the loss on the model's turns only); `extra_info.answer` is the first turn alone (the call). Scored by
  the GSM8K strict reward (`synthetic/arithmetic`: "#### N"). `call_fraction` < 1 makes the rest of the SFT
  targets a direct answer without the tool, "#### M" with M a wrong product of the same number of digits (the
  prompt and ground truth unchanged): a warm start on that mix calls the calculator in about `call_fraction` of
  its samples and is wrong otherwise, so an RL run has a choice to learn (call or guess) at the first token.
  `full_length` keeps only operand pairs whose product has all `2 * digits` digits (2-digit: 1000 and up), so the
  calculator's answer always has one length: the copy into "#### N" is then at one fixed distance from the
  tool message, which a tiny model learns reliably (with products of 3 or 4 digits it did at some seeds only).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlhf_mcore.data.preprocess import GSM8K_INSTRUCTION, find_split_files, gsm8k_row, read_records, write_parquet
from rlhf_mcore.data.schema import make_row
from rlhf_mcore.data.synthetic import DATA_SOURCE

__all__ = ["TOOL_INSTRUCTION", "multiply_texts", "multiply_rows", "write_multiply_parquet", "preprocess_gsm8k_tool"]

TOOL_INSTRUCTION = ('You can call the calculator: <tool_call>{"name": "calculator", "arguments": {"expression": '
                    '"..."}}</tool_call>.')


# Short: the chat template lists the tool's schema, and a tiny model learns to copy the operands into its call
# much sooner from a short prompt than from one that also spells out the call format.
MULTIPLY_INSTRUCTION = 'Use the calculator. Output the final answer after "####".'


def _call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def _wrong_product(rng: random.Random, product: int) -> int:
    """A number of `product`'s digit count that is not `product`: a guess at the answer."""
    lo, hi = 10 ** (len(str(product)) - 1), 10 ** len(str(product)) - 1
    guess = rng.randint(lo, hi - 1)
    return guess + (guess >= product)


def multiply_texts(digits: int = 6) -> list[str]:
    """The task's conversation layout (operands all 9s; the chat roles and the default system prompt), for a tiny
    tokenizer to learn merges from."""
    a = "9" * digits
    return ["system", "user", "assistant", "tool", "You are a helpful assistant.",
            f"What is {a} * {a}? {MULTIPLY_INSTRUCTION}", _call(f"{a} * {a}"), f"#### {a}{a}"]


def multiply_rows(n: int, seed: int = 0, split: str = "train", digits: int = 6,
                  call_fraction: float = 1.0, full_length: bool = False) -> list[dict[str, Any]]:
    if not 0.0 <= call_fraction <= 1.0:
        raise ValueError(f"call_fraction={call_fraction} must be within [0, 1] (the share of SFT targets that call "
                         f"the calculator)")
    rng = random.Random(f"rlhf_mcore.agents.multiply:{seed}:{split}:{digits}")
    choice = random.Random(f"rlhf_mcore.agents.multiply.choice:{seed}:{split}:{digits}")  # operands independent of it
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1 (the digits of each operand)")
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    rows = []
    for k in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        while full_length and len(str(a * b)) < 2 * digits:  # redraw: a product with a digit fewer
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        question = f"What is {a} * {b}? {MULTIPLY_INSTRUCTION}"
        if call_fraction == 1.0 or choice.random() < call_fraction:
            messages = [{"role": "assistant", "content": _call(f"{a} * {b}")},
                        {"role": "tool", "name": "calculator", "content": str(a * b)},  # the calculator's answer
                        {"role": "assistant", "content": f"#### {a * b}"}]
        else:
            messages = [{"role": "assistant", "content": f"#### {_wrong_product(choice, a * b)}"}]
        row = make_row(DATA_SOURCE, question, str(a * b),
                       {"split": split, "index": k, "question": question, "answer": messages[0]["content"],
                        "messages": messages})
        row["agent_name"] = "tool_agent"
        rows.append(row)
    return rows


def write_multiply_parquet(output_dir: str | Path, n: int, seed: int = 0, n_test: int | None = None,
                           digits: int = 6, call_fraction: float = 1.0,
                           full_length: bool = False) -> dict[str, dict[str, Any]]:
    """train.parquet and test.parquet; `call_fraction` shapes the SFT targets (`multiply_rows`), not the task."""
    out = Path(output_dir).expanduser()
    n_test = max(n // 10, 1) if n_test is None else n_test
    return {split: {"path": str(write_parquet(multiply_rows(k, seed, split, digits, call_fraction,
                                                                        full_length),
                                              out / f"{split}.parquet")), "rows": k}
            for split, k in (("train", n), ("test", n_test))}


def preprocess_gsm8k_tool(input_dir: str | Path, output_dir: str | Path) -> dict[str, dict[str, Any]]:
    """GSM8K with `agent_name: tool_agent` and the calculator invited in the prompt."""
    out = Path(output_dir).expanduser()
    summary = {}
    for split in ("train", "test"):
        files = find_split_files(input_dir, split)
        if not files:
            continue
        rows = []
        for path in files:
            for k, record in enumerate(read_records(path)):
                row = gsm8k_row(record, split, len(rows), f"{path}: row {k}")
                row["prompt"][0]["content"] = row["prompt"][0]["content"].replace(
                    GSM8K_INSTRUCTION, f"{TOOL_INSTRUCTION} {GSM8K_INSTRUCTION}")
                row["agent_name"] = "tool_agent"
                rows.append(row)
        summary[split] = {"path": str(write_parquet(rows, out / f"{split}.parquet")), "rows": len(rows)}
    return summary
