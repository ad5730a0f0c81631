"""What the end-to-end tests of launch/train.py share: a tiny task whose groups disagree and the metrics a run
logged (tests/launcher.py starts the runs)."""
import json
from pathlib import Path


def parity_task(tmp_path: Path, model_dir: Path, max_response_length: int = 8) -> list[str]:
    """Synthetic prompts and a reward that scores a random model's responses 0 or 1 by length (so a group's rewards
    vary); returns the train.py overrides of a small GRPO run on them (4 prompts x 4 samples, CPU, jsonl)."""
    from rlhf_mcore.data import write_synthetic_parquet

    write_synthetic_parquet(tmp_path / "syn", n=64, difficulty=0, seed=0, n_test=4)
    reward = tmp_path / "parity_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{tmp_path / 'syn' / 'train.parquet'}]",
            "data.val_files=[]", "data.train_batch_size=4", f"data.max_response_length={max_response_length}",
            "data.max_prompt_length=128", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
            "trainer.device=cpu", "trainer.logger=[jsonl]", f"custom_reward_function.path={reward}"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trace_tracks(path: Path) -> dict[tuple[int, int], list[dict]]:
    """A trainer.trace file's complete events by track ((pid, tid)), each track's in time order, after checking
    that the file is Chrome-trace JSON and that every track nests: two spans of a track are disjoint or one holds
    the other (what the viewers draw as one track; 1 us of slack for the rounding of ts and dur)."""
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms" and not doc["otherData"]["unfinished_ranks"], doc["otherData"]
    tracks: dict[tuple[int, int], list[dict]] = {}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] > 1.6e15, e  # microseconds of wall time (after 2020)
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, evs in tracks.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []  # the ends of the spans holding the current one
        for e in evs:
            while open_ends and e["ts"] >= open_ends[-1] - 1:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1, (key, e)  # inside its holder
            open_ends.append(e["ts"] + e["dur"])
    return tracks


def step_phases(track: list[dict]) -> dict[int, list[str]]:
    """Per step (the `step` spans' `args.step`), the names of the spans directly inside it, in time order."""
    out = {}
    for s in (e for e in track if e["name"] == "step"):
        end = s["ts"] + s["dur"]
        inner = [e for e in track if e is not s and s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end + 1]
        held = lambda e, o: o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] and o["dur"] > e["dur"]  # noqa: E731
        direct = [e for e in inner if not any(held(e, o) for o in inner if o is not e)]
        out[s["args"]["step"]] = [e["name"] for e in direct]
    return out


def process_names(path: Path) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def track_names(path: Path) -> dict[tuple[int, int], str]:
    """Each track's ((pid, tid)) name: `main`, a thread's name, or a lane's (`reward worker 0`)."""
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def spans_in(track: list[dict], outer: dict, name: str) -> list[dict]:
    """The spans called `name` inside `outer` on `track` (1 us of slack for rounding), in time order."""
    return [e for e in track if e["name"] == name and outer["ts"] - 1 <= e["ts"]
            and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1]


def check_buckets(track: list[dict], outer: dict, record: dict) -> list[dict]:
    """The weight-sync buckets inside `outer` (a sync's span) are the sync the step logged: `sync/buckets` of them,
    numbered in order, their bytes adding up to `sync/bytes`. Returns them."""
    buckets = spans_in(track, outer, "weight bucket")
    assert [b["args"]["index"] for b in buckets] == list(range(int(record["sync/buckets"]))), (outer, buckets)
    assert sum(b["args"]["bytes"] for b in buckets) == record["sync/bytes"], (outer, buckets)
    return buckets


def check_reward_workers(path: Path, pid: int, workers: int) -> None:
    """A rank's reward worker processes (`reward.num_workers`) each on a track of their own: every scored item on
    one of them (as many as the rank's `score` spans counted), inside a `score` span of the rank (one clock), one
    item at a time per worker."""
    tracks, names = trace_tracks(path), track_names(path)
    lanes = {names[k]: v for k, v in tracks.items() if k[0] == pid and names[k].startswith("reward worker ")}
    assert sorted(lanes) == [f"reward worker {k}" for k in range(workers)], sorted(names.values())
    scores = [e for k, v in tracks.items() if k[0] == pid for e in v if e["name"] == "score"]
    items = [e for v in lanes.values() for e in v]
    assert len(items) == sum(e["args"]["items"] for e in scores) > 0 and {e["name"] for e in items} == {"reward item"}
    assert all(any(s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in scores)
               for e in items), "a reward item outside every score span"
    for lane in lanes.values():
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(lane, lane[1:])), lane  # one item at a time


def check_plain_log(stdout: str, stderr: str, once: list[str]) -> None:
    """A run's output when it is not a terminal (a test's pipes, a log file): plain lines, no progress bar (its
    carriage-return frames: text-mode pipes turn each into a line of its own, `NN%|...`), no line said twice (once
    per rank, once per resume), and each of `once` (a line's start) on exactly one line."""
    import re

    text = stdout + stderr
    bars = [x for x in text.splitlines() if re.search(r"\d+%\|", x)]
    assert "\r" not in text and not bars, (bars[:5], text[-3000:])
    lines = [x for x in text.splitlines() if x.strip()]
    repeated = sorted({x for x in lines if lines.count(x) > 1})
    assert not repeated, (repeated, text[-3000:])
    for start in once:
        assert sum(x.startswith(start) for x in lines) == 1, (start, text[-3000:])


def check_summary(stdout: str, out: Path) -> list[str]:
    """launch/train.py's end-of-run summary (rank 0, once) against the run's metrics.jsonl: the steps, the first and
    last training reward, each data source's best and last held-out accuracy, and the outputs it names exist.
    Returns the summary's lines."""
    import re

    lines = stdout.splitlines()
    assert sum(x.startswith("run summary: ") for x in lines) == 1, stdout[-3000:]
    at = next(i for i, x in enumerate(lines) if x.startswith("run summary: "))
    summary = [lines[at]] + [x for x in lines[at + 1:] if x.startswith("  ")]
    recs = records(out)
    train = [r for r in recs if r["kind"] == "train"]
    val = [r for r in recs if r["kind"] == "val"]
    assert re.match(rf"run summary: {train[-1]['step']} steps?, \d+ s$", summary[0]), summary
    first, last = train[0], train[-1]
    want = (f"  training reward     first {first['critic/score/mean']:.4f} (step {first['step']}), "
            f"last {last['critic/score/mean']:.4f} (step {last['step']})")
    assert want in summary, (want, summary)
    for key in {k for r in val for k in r if k.startswith("val/") and k.endswith("/acc")}:
        pts = [(r["step"], r[key]) for r in val if key in r]
        best = max(v for _, v in pts)
        source = "all" if key == "val/acc" else key[4:-4]
        assert (f"  held-out accuracy   {source}: best {best:.4f} (step {next(s for s, v in pts if v == best)}), "
                f"last {pts[-1][1]:.4f} (step {pts[-1][0]})") in summary, (key, summary)
    named = {x.split()[0]: x.split()[1] for x in summary[1:] if x.split()[0] in ("metrics", "plots", "trace")}
    for what, path in named.items():
        assert Path(path).is_file(), (what, path)
    return summary
