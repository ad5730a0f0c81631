"""Write RL datasets as parquet in veRL's schema (train.parquet, test.parquet).

    python launch/preprocess_data.py gsm8k [--input-dir DIR] --output-dir ~/data/gsm8k
    python launch/preprocess_data.py math --input-dir DIR --output-dir ~/data/math
    python launch/preprocess_data.py synthetic --n 2000 --difficulty 1 --seed 0 --output-dir ~/data/arith
    python launch/preprocess_data.py synthetic-preferences --n 2000 --output-dir ~/data/arith_prefs
    python launch/preprocess_data.py gsm8k_tool --output-dir ~/data/gsm8k_tool     # agent_name: tool_agent
    python launch/preprocess_data.py multiply --n 2000 --output-dir ~/data/multiply  # needs the calculator

`gsm8k` reads the vendored copy of GSM8K unless --input-dir points elsewhere; inputs are jsonl or parquet
files named train/test (or Hugging Face hub shards). `math` reads MATH records with `problem` and `solution`.
`synthetic-preferences` writes preference pairs (prompt, chosen, rejected) from the synthetic task, the answer in
the format the reward accepts preferred (rlhf_mcore.data.preferences), for launch/train_rm.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from rlhf_mcore.cli import report_user_errors
from rlhf_mcore.data.preferences import write_synthetic_preferences
from rlhf_mcore.data.preprocess import VENDORED_GSM8K_DIR, preprocess_gsm8k, preprocess_math
from rlhf_mcore.data.synthetic import write_synthetic_parquet


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)

    gsm8k = sub.add_parser("gsm8k", help="GSM8K (openai/gsm8k)")
    gsm8k.add_argument("--input-dir", default=str(VENDORED_GSM8K_DIR), help="default: the vendored GSM8K")
    gsm8k.add_argument("--output-dir", default="~/data/gsm8k")
    gsm8k.add_argument("--on-bad-row", choices=["error", "skip"], default="error")

    math = sub.add_parser("math", help="MATH (problem/solution records; ground truth = last \\boxed{})")
    math.add_argument("--input-dir", required=True)
    math.add_argument("--output-dir", default="~/data/math")
    math.add_argument("--on-bad-row", choices=["error", "skip"], default="error")
    math.add_argument("--data-source", default="DigitalLearningGmbH/MATH-lighteval",
                      help="data_source written into every row (selects the reward function)")

    synthetic = sub.add_parser("synthetic", help="synthetic arithmetic word problems (synthetic/arithmetic)")
    synthetic.add_argument("--n", type=int, required=True, help="training rows")
    synthetic.add_argument("--n-test", type=int, default=None, help="test rows (default: n // 10)")
    synthetic.add_argument("--difficulty", type=int, default=1,
                           help="number of operations (0 = read the number back, 1 = 'a + b', ...)")
    synthetic.add_argument("--max-operand", type=int, default=None, help="largest operand (default by difficulty)")
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.add_argument("--output-dir", default="~/data/synthetic_arithmetic")

    prefs = sub.add_parser("synthetic-preferences", help="preference pairs from the synthetic task (reward models)")
    prefs.add_argument("--n", type=int, required=True, help="training pairs")
    prefs.add_argument("--n-test", type=int, default=None, help="held-out pairs (default: n // 10)")
    prefs.add_argument("--difficulty", type=int, default=0)
    prefs.add_argument("--max-operand", type=int, default=None, help="largest operand (default by difficulty)")
    prefs.add_argument("--rejected-kinds", default="wrong_number,full_stop,both",
                       help="comma-separated: wrong_number, full_stop, both (equal shares)")
    prefs.add_argument("--seed", type=int, default=0)
    prefs.add_argument("--output-dir", default="~/data/synthetic_preferences")
    gsm8k_tool = sub.add_parser("gsm8k_tool", help="GSM8K for tool_agent with the calculator (multi-turn)")
    gsm8k_tool.add_argument("--input-dir", default=str(VENDORED_GSM8K_DIR), help="default: the vendored GSM8K")
    gsm8k_tool.add_argument("--output-dir", default="~/data/gsm8k_tool")

    multiply = sub.add_parser("multiply", help="multiply two 6-digit numbers: a tool task (tool_agent, calculator)")
    multiply.add_argument("--n", type=int, required=True, help="training rows")
    multiply.add_argument("--n-test", type=int, default=None, help="test rows (default: n // 10)")
    multiply.add_argument("--digits", type=int, default=6, help="digits of each operand")
    multiply.add_argument("--full-length", action="store_true",
                          help="only operand pairs whose product has all its digits (one length of answer)")
    multiply.add_argument("--seed", type=int, default=0)
    multiply.add_argument("--call-fraction", type=float, default=1.0,
                          help="share of SFT targets that call the calculator; the rest guess a wrong product")
    multiply.add_argument("--output-dir", default="~/data/multiply")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    def body():
        if args.task == "gsm8k":
            return preprocess_gsm8k(args.input_dir, args.output_dir, on_bad_row=args.on_bad_row)
        if args.task == "math":
            return preprocess_math(args.input_dir, args.output_dir, on_bad_row=args.on_bad_row,
                                   data_source=args.data_source)
        if args.task == "synthetic-preferences":
            return write_synthetic_preferences(args.output_dir, args.n, args.seed, args.n_test, args.difficulty,
                                               max_operand=args.max_operand,
                                               rejected_kinds=tuple(args.rejected_kinds.split(",")))
        if args.task in ("gsm8k_tool", "multiply"):
            from rlhf_mcore.agents.tasks import preprocess_gsm8k_tool, write_multiply_parquet

            if args.task == "gsm8k_tool":
                return preprocess_gsm8k_tool(args.input_dir, args.output_dir)
            return write_multiply_parquet(args.output_dir, args.n, args.seed, args.n_test, args.digits,
                                          args.call_fraction, args.full_length)
        return write_synthetic_parquet(args.output_dir, args.n, args.difficulty, args.seed, args.n_test,
                                       max_operand=args.max_operand)

    summary = {}
    rc = report_user_errors(lambda: summary.update(body()))
    if rc:
        return rc
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
