"""Offline generation with a rollout engine and the model's chat template.

    python launch/generate.py --model DIR --input prompts.parquet|.jsonl --output out.jsonl \
        [--engine native|hf|sglang] [--n 4] [--temperature 1.0] [--top-p 1.0] [--top-k -1] \
        [--max-new-tokens 512] [--seed 0]

Each input row carries `prompt`, either chat messages ([{"role": "user", "content": ...}], veRL's parquet
schema) or a plain string (sent as one user message). The chat template is applied with
add_generation_prompt=True. `--temperature 0` is greedy (then --n must be 1).

Output: one JSON line per input row, in input order: the row's own fields plus `responses` (texts),
`response_ids`, `logprobs` (per token) and `finish_reasons`, one entry per sample.

Agent loops (multi-turn, rlhf_mcore.agents): `--agent NAME` runs loop NAME (`single_turn_agent`, `tool_agent`,
`env_agent`, or one registered by a `--plugins` file) for rows without an `agent_name` column of their own;
`--tools YAML` lists the tools (as multi_turn.tool_config_path; their schemas go to the chat template's `tools`);
`--max-new-tokens` bounds a trajectory's whole response, tool messages included. Each sample then also carries
`response_mask` (1 on model tokens, 0 on tool / environment tokens), `logprobs` of the model tokens only (one
per 1 in the mask), `turns` (role and span in `response_ids` of every turn), `tool_calls` (every call the model
made: its turn, name and arguments, or the parse error; outcome: ok / malformed / unknown / rejected / exceptions
/ timeouts; seconds), `messages` (the whole conversation, decoded), `stats` and `reward` (an environment's, else
null).

    python launch/generate.py --model DIR --input multiply/test.parquet --output out.jsonl \
        --agent tool_agent --tools configs/tools/calculator.yaml --max-turns 3 --max-new-tokens 256
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


def sample_fields(tok, samples) -> dict:
    """One row's output fields of single-turn samples."""
    return {"responses": [tok.decode(s.token_ids, skip_special_tokens=True) for s in samples],
            "response_ids": [s.token_ids for s in samples], "logprobs": [s.logprobs for s in samples],
            "finish_reasons": [s.finish_reason for s in samples]}


def agent_setup(args) -> dict:
    """The agent runner's settings and tools from the command line (ValueError names the bad flag)."""
    from rlhf_mcore.agents import MultiTurnSettings, get_agent, load_tool_config
    from rlhf_mcore.config import load_plugins

    load_plugins(list(args.plugins))
    try:
        get_agent(args.agent)  # an unknown name fails now, listing the known ones
    except ValueError as e:
        raise ValueError(f"--agent: {e}") from None
    if args.max_turns < 1 or args.max_user_turns < 0 or (args.max_tokens_per_turn or 1) < 1 or args.tool_timeout <= 0:
        raise ValueError(f"--max-turns {args.max_turns} must be >= 1, --max-user-turns {args.max_user_turns} >= 0, "
                         f"--max-tokens-per-turn {args.max_tokens_per_turn} >= 1 and --tool-timeout "
                         f"{args.tool_timeout} > 0.")
    if args.tools and not Path(args.tools).is_file():
        raise ValueError(f"--tools {args.tools}: file not found (e.g. configs/tools/calculator.yaml).")
    tools = load_tool_config(args.tools) if args.tools else {}
    settings = MultiTurnSettings(max_assistant_turns=args.max_turns, max_user_turns=args.max_user_turns,
                                 max_tokens_per_turn=args.max_tokens_per_turn, tool_timeout_s=args.tool_timeout,
                                 default_agent=args.agent)
    return {"settings": settings, "tools": tools, "schemas": [t.schema() for t in tools.values()] or None}


def run_agents(engine, tok, runner_kw: dict, rows: list[dict], messages: list[list[dict]],
               prompt_ids: list[list[int]], params, error) -> list[dict]:
    """Every row's `params.n` trajectories as its output fields (the module docstring lists them)."""
    from rlhf_mcore.agents import AgentError, AgentRunner

    items = [{"raw_prompt": m, "agent_name": r.get("agent_name"), "data_source": r.get("data_source"),
              "ground_truth": (r.get("reward_model") or {}).get("ground_truth"),
              "extra_info": r.get("extra_info") or {}, "index": i} for i, (r, m) in enumerate(zip(rows, messages))]
    runner = AgentRunner(engine, tok, runner_kw["settings"], runner_kw["tools"])
    try:
        trajs = runner.run(prompt_ids, items, params) if rows else []
    except (AgentError, ValueError) as e:
        error(str(e))

    return [{"responses": [tok.decode(t.response_ids, skip_special_tokens=True) for t in per],
             "response_ids": [t.response_ids for t in per], "response_mask": [t.response_mask for t in per],
             "logprobs": [t.model_logprobs for t in per],
             "finish_reasons": [t.finish_reason for t in per], "turns": [t.turns for t in per],
             "tool_calls": [t.tool_calls for t in per], "messages": [t.messages for t in per],
             "stats": [t.stats for t in per], "reward": [t.reward for t in per]} for per in trajs]


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
    a = p.add_argument_group("agent loops (multi-turn)")
    a.add_argument("--agent", default=None, help="agent loop of rows without an `agent_name` (e.g. tool_agent)")
    a.add_argument("--tools", default=None, help="tool config YAML (e.g. configs/tools/calculator.yaml)")
    a.add_argument("--plugins", nargs="*", default=[], help=".py files or modules registering tools / agents")
    a.add_argument("--max-turns", type=int, default=5, help="model turns per trajectory")
    a.add_argument("--max-user-turns", type=int, default=5, help="environment / user turns per trajectory")
    a.add_argument("--max-tokens-per-turn", type=int, default=None, help="default: what is left of the budget")
    a.add_argument("--tool-timeout", type=float, default=30.0, help="seconds per tool call")
    args = p.parse_args(argv)
    if args.agent is None and (args.tools or args.plugins):
        p.error("--tools / --plugins are for agent loops: add --agent NAME (e.g. --agent tool_agent).")

    model_dir, in_path, out_path = Path(args.model), Path(args.input), Path(args.output)
    if not (model_dir / "config.json").is_file():
        p.error(f"--model {model_dir}: not a Hugging Face model directory (no config.json there).")
    if not in_path.is_file():
        p.error(f"--input {in_path}: file not found.")

    from rlhf_mcore.config import model_max_positions
    from rlhf_mcore.errors import UserError
    from rlhf_mcore.models.tokenizer import load_tokenizer
    from rlhf_mcore.rollout import SamplingParams, build_rollout_engine

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
        rows = read_rows(in_path)
        if rows and "prompt" not in rows[0]:
            raise ValueError(f"--input {in_path}: rows have no `prompt` field (found {sorted(rows[0])}).")
        tok = load_tokenizer(model_dir, "--model")  # a ValueError: one line naming the directory's missing files
        runner_kw = agent_setup(args) if args.agent is not None else None
        template_kw = {"tools": runner_kw["schemas"]} if runner_kw and runner_kw["schemas"] else {}
        messages = [to_messages(r["prompt"], i) for i, r in enumerate(rows)]
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **template_kw)
                 for m in messages]
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
    try:
        engine = build_rollout_engine(args.engine, model_dir, **cfg)
    except UserError as e:  # the model directory: an unsupported architecture, weights config.json does not describe
        p.error(str(e))
    if runner_kw is not None:
        records = run_agents(engine, tok, runner_kw, rows, messages, prompt_ids, params, p.error)
    else:
        records = [sample_fields(tok, out.samples) for out in (engine.generate(prompt_ids, params) if prompt_ids
                                                               else [])]

    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f:
        for row, fields in zip(rows, records):
            f.write(json.dumps({**_jsonable(row), **fields}) + "\n")
    engine.shutdown()
    print(f"wrote {len(records)} rows to {out_path}", file=sys.stderr)
    return out_path


if __name__ == "__main__":
    main()
