"""Offline generation with a rollout engine and the model's chat template.

    python launch/generate.py --model DIR --input prompts.parquet|.jsonl --output out.jsonl \
        [--engine native|hf|sglang] [--n 4] [--temperature 1.0] [--top-p 1.0] [--top-k -1] \
        [--max-new-tokens 512] [--seed 0]

Each input row carries `prompt`, either chat messages ([{"role": "user", "content": ...}], veRL's parquet
schema) or a plain string (sent as one user message). The chat template is applied with
add_generation_prompt=True. `--temperature 0` is greedy (then --n must be 1).

Output: one JSON line per input row, in input order: the row's own fields plus `responses` (texts),
`response_ids`, `logprobs` (per token) and `finish_reasons`, one entry per sample.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def read_rows(path: Path) -> list[dict]:
    """Rows of a .parquet or .jsonl file as dicts."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"--input {path}: unsupported extension {path.suffix!r}; use .parquet or .jsonl.")


def to_messages(prompt, row_index: int) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ValueError(f"row {row_index}: `prompt` must be a string or a list of {{'role', 'content'}} messages, "
                     f"got {type(prompt).__name__}.")


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy scalars / arrays
        return x.tolist()
    return x


def fit_to_context(prompt_ids: list[list[int]], context: int | None, max_new_tokens: int, mode: str,
                   error) -> list[list[int]]:
    """Each prompt must leave `max_new_tokens` of the model's `context` (max_position_embeddings): else
    `error(message)` (mode "error") or keep the prompt's last tokens (mode "left", reported once)."""
    if context is None:
        return prompt_ids
    room = context - max_new_tokens
    if room <= 0:
        error(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of {context} "
              f"tokens (max_position_embeddings): lower --max-new-tokens.")
    long = [i for i, ids in enumerate(prompt_ids) if len(ids) > room]
    if not long:
        return prompt_ids
    if mode == "error":
        i = long[0]
        error(f"row {i}: its prompt is {len(prompt_ids[i])} tokens, but the model's context of {context} tokens "
              f"leaves {room} after --max-new-tokens {max_new_tokens} ({len(long)} row(s) too long): shorten the "
              f"prompts, lower --max-new-tokens, or pass --truncate-prompts left.")
    print(f"--truncate-prompts left: {len(long)} prompt(s) cut to their last {room} tokens", file=sys.stderr)
    return [ids[-room:] if len(ids) > room else ids for ids in prompt_ids]


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--input", required=True, help=".parquet or .jsonl with a `prompt` column")
    p.add_argument("--output", required=True, help="output .jsonl")
    p.add_argument("--engine", choices=("native", "hf", "sglang"), default="native")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256, help="native: concurrent sequences")
    p.add_argument("--device", default=None, help="native/hf: cuda or cpu (default: cuda if available)")
    p.add_argument("--truncate-prompts", choices=("error", "left"), default="error",
                   help="a prompt that leaves no room for --max-new-tokens in the model's context: stop with the "
                        "row named (error, default) or keep its last tokens (left, counted in a message)")
    args = p.parse_args(argv)

    model_dir, in_path, out_path = Path(args.model), Path(args.input), Path(args.output)
    if not (model_dir / "config.json").is_file():
        p.error(f"--model {model_dir}: not a Hugging Face model directory (no config.json there).")
    if not in_path.is_file():
        p.error(f"--input {in_path}: file not found.")

    from transformers import AutoTokenizer

    from rlhf_mcore.config import model_max_positions
    from rlhf_mcore.rollout import SamplingParams, build_rollout_engine

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
        rows = read_rows(in_path)
        if rows and "prompt" not in rows[0]:
            raise ValueError(f"--input {in_path}: rows have no `prompt` field (found {sorted(rows[0])}).")
        tok = AutoTokenizer.from_pretrained(model_dir)
        texts = [tok.apply_chat_template(to_messages(r["prompt"], i), tokenize=False, add_generation_prompt=True)
                 for i, r in enumerate(rows)]
    except ValueError as e:
        p.error(str(e))
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    prompt_ids = fit_to_context(prompt_ids, model_max_positions(str(model_dir)), args.max_new_tokens,
                                args.truncate_prompts, p.error)

    cfg = {}
    if args.engine == "native":
        longest = max((len(x) for x in prompt_ids), default=1)
        cfg = dict(max_num_seqs=args.max_num_seqs, max_model_len=longest + args.max_new_tokens, show_progress=True)
    if args.engine in ("native", "hf") and args.device:
        cfg["device"] = args.device
    if args.engine == "hf":
        cfg["show_progress"] = True
    engine = build_rollout_engine(args.engine, model_dir, **cfg)
    outputs = engine.generate(prompt_ids, params) if prompt_ids else []

    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f:
        for row, out in zip(rows, outputs):
            rec = _jsonable(row)
            rec["responses"] = [tok.decode(s.token_ids, skip_special_tokens=True) for s in out.samples]
            rec["response_ids"] = [s.token_ids for s in out.samples]
            rec["logprobs"] = [s.logprobs for s in out.samples]
            rec["finish_reasons"] = [s.finish_reason for s in out.samples]
            f.write(json.dumps(rec) + "\n")
    engine.shutdown()
    print(f"wrote {len(outputs)} rows to {out_path}", file=sys.stderr)
    return out_path


if __name__ == "__main__":
    main()
