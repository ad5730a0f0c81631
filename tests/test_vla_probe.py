"""launch/vla_probe.py (issue 37's diagnostic loop over the VLA trainer's pieces): it reaches into the trainer's
internals (`VLARun._policy_fn`, `train_states`, `training_batch`, `_keyed_generator`), so a change there must
fail here rather than the day someone needs the probe."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cost(25)


def test_probe_runs_and_reloads_its_cached_warm_start(tmp_path, capsys, cpu_only):
    """Two short probes of one seed: the first runs behaviour cloning and caches it, the second loads it (and says
    so) and starts from the same weights: the same first-step entropy. Every record has its diagnostics, finite;
    both runs are appended to results.jsonl, and the process group is gone after each (a later test in the same
    process found it initialized once). Mutation: the `ck.load_checkpoint` call removed (its message kept) ->
    the second run starts from the untrained model and the entropies differ."""
    sys.path.insert(0, str(ROOT / "launch"))
    import vla_probe

    argv = ["--steps", "2", "--states", "2", "--n", "2", "--bc-steps", "3", "--val-every", "1", "--analyse",
            "--val-sampled", "1", "--fixed", "2", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]
    first = vla_probe.main(argv)
    assert "loaded the warm start" not in capsys.readouterr().out
    second = vla_probe.main(argv)
    assert "loaded the warm start" in capsys.readouterr().out
    for res in (first, second):
        assert [v["step"] for v in res["vals"]] == [0, 1, 2] and [t["step"] for t in res["train"]] == [1, 2]
        for rec in res["train"]:
            assert {"succ", "mixed", "pos_w", "ent", "clip", "kl", "gn", "gain", "dpos", "dneg"} <= set(rec)
            assert all(math.isfinite(v) for v in rec.values())
        assert {"greedy", "sampled", "sampled_any", "fail_near_other", "fail_short"} <= set(res["vals"][0])
    assert second["train"][0]["ent"] == pytest.approx(first["train"][0]["ent"], abs=1e-6)
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["args"]["bc_steps"] == 3
    assert not torch.distributed.is_initialized()  # nothing left for the next test in this process
