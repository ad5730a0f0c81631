"""`trainer.cuda_expandable_segments`: the decision (setting, rollout engine, environment), the call into torch, the
config's checks, the trainer passing it to `init_distributed`, and on a GPU the allocator's segments."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from launcher import env as child_env

from rlhf_mcore.config import ConfigError, load_config
from rlhf_mcore.parallel.allocator import expandable_segments_wanted, set_expandable_segments

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["actor_rollout_ref.model.path=/models/m"]


@pytest.mark.parametrize("setting, engine, environ, wanted", [
    ("auto", "native", {}, True),
    ("auto", "hf", {}, True),
    ("auto", "sglang", {}, None),  # its weight updates open CUDA IPC handles of the trainer's tensors
    ("auto", "native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),  # the user's choice
    ("auto", "native", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}, None),
    ("auto", "native", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, True),  # other settings: still on
    (True, "sglang", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True),  # the config decides
    (False, "native", {}, False),
])
def test_expandable_segments_by_setting_engine_and_environment(setting, engine, environ, wanted):
    """Mutations: the environment not read (`return None` dropped) -> the two environment cases give True, fail;
    `in OUT_OF_PROCESS_ROLLOUTS` -> `not in` -> the native and sglang cases flip, fail."""
    assert expandable_segments_wanted(setting, engine, environ) is wanted


def test_set_expandable_segments_hands_the_setting_to_torch(monkeypatch):
    """The string torch's allocator parses, through torch >= 2.13's setter or the older CUDA one. Mutation: the
    'True' / 'False' swapped -> fails."""
    seen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append, raising=False)
    set_expandable_segments(True)
    set_expandable_segments(False)
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append)
    set_expandable_segments(True)
    assert seen == ["expandable_segments:True", "expandable_segments:False", "expandable_segments:True"]


def test_the_setting_is_checked_at_load():
    assert load_config(None, MODEL).trainer.cuda_expandable_segments == "auto"
    assert load_config(None, MODEL + ["trainer.cuda_expandable_segments=false"]).trainer.cuda_expandable_segments \
        is False
    with pytest.raises(ConfigError, match=r"'trainer\.cuda_expandable_segments' has value 'maybe'; it must be auto, "
                                          r"true or false"):
        load_config(None, MODEL + ["trainer.cuda_expandable_segments=maybe"])
    with pytest.raises(ConfigError, match=r"'trainer\.cuda_expandable_segments' has value True; it must be auto or "
                                          r"false with trainer\.device=cpu.*set trainer\.device=auto or cuda"):
        load_config(None, MODEL + ["trainer.device=cpu", "trainer.cuda_expandable_segments=true"])


class _Stop(Exception):
    pass


@pytest.mark.parametrize("overrides, wanted", [([], True), (["trainer.cuda_expandable_segments=false"], False),
                                                (["actor_rollout_ref.rollout.name=sglang"], None)])
def test_the_trainer_hands_the_decision_to_init_distributed(monkeypatch, tmp_path, overrides, wanted):
    """RunContext.open passes the config's decision to the process-group set-up, which applies it before the first
    CUDA allocation. Mutation: run.py not passing `expandable_segments=` -> None everywhere, fails."""
    from rlhf_mcore.trainer import roles, run

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cfg = load_config(None, MODEL + [f"trainer.default_local_dir={tmp_path}", *overrides])
    monkeypatch.setattr(roles, "build_data", lambda cfg: (None, [], []))
    monkeypatch.setattr(roles, "build_scorer", lambda cfg: None)
    seen = {}

    def fake_init(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(run, "init_distributed", fake_init)
    with pytest.raises(_Stop):
        run.RunContext.open(cfg)
    assert seen["expandable_segments"] is wanted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the allocator's segments)")
@pytest.mark.parametrize("on", [True, False])
def test_init_distributed_sets_the_allocators_segments_on_a_gpu(on):
    """In a fresh process (the setting is process-wide): `init_distributed(expandable_segments=on)`, then an
    allocation; the allocator's snapshot says whether its segment is expandable. Mutation: `set_expandable_segments`
    called after `torch.cuda.set_device` and an allocation -> the first segment is a plain one, fails with on=True."""
    code = textwrap.dedent(f"""
        import os, torch
        for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            os.environ.pop(k, None)
        from rlhf_mcore.parallel import init_distributed
        init_distributed(device="cuda", expandable_segments={on})
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        print("EXPANDABLE", sorted({{bool(s.get("is_expandable")) for s in torch.cuda.memory_snapshot()}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("EXPANDABLE"))
    assert line == f"EXPANDABLE [{on}]", line
