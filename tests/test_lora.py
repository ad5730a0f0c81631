"""LoRA (rlhf_mcore.models.lora, sync/lora.py) against transformers + peft, fp32 on CPU.

In one process (TP=PP=1):
- the adapted forward equals peft's on the same adapter weights (written by `save_peft_adapter`, loaded by
  `peft.PeftModel.from_pretrained`), and a peft-made adapter (q/v/down only: partly fused layers) loads as the start;
- only the adapters get gradients, optimizer state and updates; the base stays bitwise as loaded;
- the reference (adapters off) equals a separately built base model's log-probs bitwise;
- Llama's and Qwen3's adapters load in peft under PEFT's module names;
- the exported (synced) weights are peft's `merge_and_unload` weights, and the rollout holds them after the
  trainer's sync, merged (the default) or adapter-only, and after the asynchronous modes' broadcast push;
- checkpoints hold the adapters and their optimizer state, resume bitwise, refuse another base;
- the critic's LoRA trains its adapters and value head; config errors name the key, the value and the fix.
One 2-process launch (tests/scripts/lora_cases.py): TP=2 and PP=2 against peft and TP=1, a TP=2 checkpoint loaded
at PP=2. One 2-process `one_step_off` training run: merged weights verified at every sync (the rollout pool's
engine read back), the PEFT and merged exports, convert_checkpoint.py's LoRA path.
"""
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cost(65)  # one 2-process launch (TP=2, PP=2) and one 2-process training run

ROOT = Path(__file__).resolve().parents[1]
RANK, ALPHA = 4, 8.0
B, P, R = 4, 5, 6


@pytest.fixture(scope="module")
def env(tiny_model_dir):
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    if torch.cuda.is_available():  # as tests/test_train_cuda_graphs.py's CPU engine test
        pytest.skip("a CPU engine would hide the GPUs from this whole process (cpu_compat), failing the GPU tests "
                    "that share its pytest worker; the 2-process CPU launches below still run")
    state = init_distributed(device="cpu")
    model_dir = tiny_model_dir(arch="qwen2", vocab=1000, layers=2, heads=4, kv_heads=2)
    yield state, model_dir
    destroy_distributed()


def config(model_dir, *extra):
    from rlhf_mcore.config import load_config

    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.lora_rank=4",
                              "actor_rollout_ref.model.lora_alpha=8", "trainer.device=cpu",
                              "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.train_batch_size=4",
                              *extra])


def make_batch(vocab: int = 1000) -> dict:
    """Full prompts (P tokens), right-padded responses (1..R tokens): positions equal HF's exactly."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    for b in range(B):
        mask[b, P + 1 + b:] = 0
    adv = torch.randn(B, R, generator=g)
    m = mask[:, P:].clone()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, P:].clone(), "response_mask": m, "advantages": adv * m}


def hf_log_probs(model, batch) -> torch.Tensor:
    """Naive: log_softmax of the HF model's logits at the positions predicting each response token."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    lp = torch.log_softmax(logits[:, P - 1:-1], dim=-1).gather(-1, batch["responses"][..., None])[..., 0]
    return lp * batch["response_mask"]


def randomize_adapters(chunks, seed: int = 0) -> None:
    from rlhf_mcore.models.lora import adapter_modules

    g = torch.Generator().manual_seed(seed)
    for _, _, lora in adapter_modules(chunks):
        for t in lora.A:
            lora.A[t].data.copy_(torch.randn(lora.A[t].shape, generator=g) * 0.2)
            lora.B[t].data.copy_(torch.randn(lora.B[t].shape, generator=g) * 0.2)


def peft_model(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module")
def actor(env):
    """The actor engine of a LoRA run (all-linear, r=4, alpha=8) with random non-zero adapters."""
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    engine = roles.build_actor(config(model_dir), state, total_steps=2)
    randomize_adapters(engine.chunks)
    return engine


def test_forward_equals_peft_and_the_exported_adapter_loads_in_peft(env, actor, tmp_path):
    """Our PEFT directory loads in peft and peft's log-probs equal ours (fused QKV and [gate; up] included).
    Mutation: `fuse` puts k before q in the fused QKV rows -> fails; drop `* self.scale` -> fails."""
    from rlhf_mcore.models.lora import save_peft_adapter

    state, model_dir = env
    save_peft_adapter(actor.chunks, state, tmp_path / "adapter", actor.lora, str(model_dir))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (RANK, ALPHA, "LORA")
    batch = make_batch()
    ours, _ = actor.compute_log_probs(batch)
    want = hf_log_probs(peft_model(model_dir, tmp_path / "adapter"), batch)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
    model = peft_model(model_dir, tmp_path / "adapter")
    with model.disable_adapter():
        base = hf_log_probs(model, batch)
    assert (ours - base).abs().max() > 1e-2  # the adapters change the model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_llama_and_qwen3_adapters_use_pefts_names(env, tiny_model_dir, tmp_path, arch):
    """PEFT's module names of Llama (no QKV bias, untied head) and Qwen3 (QK-norm after q_proj / k_proj): our
    adapter directory loads in peft with no missing or unexpected tensor and gives our log-probs (1e-5).
    Mutation: `peft_name` writes `attn` for `self_attn` -> fails (peft loads no q/k/v/o adapter)."""
    from rlhf_mcore.models.lora import save_peft_adapter
    from rlhf_mcore.trainer import roles

    state, _ = env
    model_dir = tiny_model_dir(arch=arch, vocab=1000, layers=2, heads=4, kv_heads=2)
    engine = roles.build_actor(config(model_dir), state, total_steps=2)
    randomize_adapters(engine.chunks, seed=2)
    save_peft_adapter(engine.chunks, state, tmp_path / "adapter", engine.lora, str(model_dir))
    batch = make_batch()
    ours, _ = engine.compute_log_probs(batch)
    torch.testing.assert_close(ours, hf_log_probs(peft_model(model_dir, tmp_path / "adapter"), batch), atol=1e-5,
                               rtol=0)


def test_reference_is_the_base_model_bitwise(env, actor):
    """The reference of a LoRA run is the actor with its adapters off: bitwise a separately built base model
    micro-batched as the actor's forward passes are (2 sequences: on some CPUs, e.g. AMD EPYC, a GEMM's rows round
    differently with the number of rows, so 1-sequence micro-batches differed by 1e-6 there).
    Mutation: `adapters_disabled` leaves `enabled` True -> fails."""
    from rlhf_mcore.config import lora_enabled, reference_enabled
    from rlhf_mcore.engine import build_engine
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    cfg = config(model_dir, "actor_rollout_ref.actor.use_kl_loss=true")
    assert lora_enabled(cfg) and reference_enabled(cfg)
    ref = roles.build_reference(cfg, state, actor)
    assert isinstance(ref, roles.AdapterFreeReference)
    batch = make_batch()
    base = build_engine(config(model_dir, "actor_rollout_ref.model.lora_rank=0",
                               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"), state, role="ref")
    want, _ = base.compute_log_probs(batch)
    got, _ = ref.compute_log_probs(batch)
    assert torch.equal(got, want)
    with_adapters, _ = actor.compute_log_probs(batch)  # and the adapters are back on afterwards
    assert (with_adapters - want).abs().max() > 1e-2


def test_only_the_adapters_train(env, actor):
    """Base frozen: no gradient buffer, no optimizer state, bitwise unchanged by an update; every adapter moves.
    Mutation: drop `chunk.requires_grad_(False)` in apply_lora -> fails."""
    from rlhf_mcore.models.lora import adapter_modules

    adapters = {id(p) for _, _, lora in adapter_modules(actor.chunks) for p in lora.parameters()}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    chunk = actor.chunks[0]
    trainable = [p for p in chunk.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == adapters
    ddp = actor.modules[0]
    assert sum(b.numel_unpadded for b in ddp.buffers) == sum(p.numel() for p in trainable)  # grad buffer: adapters
    opt_params = [p for g in actor.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == sum(p.numel() for p in trainable)
    base_before = {n: p.detach().clone() for n, p in chunk.named_parameters() if ".lora." not in n}
    lora_before = {n: p.detach().clone() for n, p in chunk.named_parameters() if ".lora." in n}
    batch = make_batch()
    old, _ = actor.compute_log_probs(batch)
    metrics = actor.update_policy({**batch, "old_log_probs": old})
    assert metrics["actor/grad_norm"] > 0
    after = dict(chunk.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items())
    assert all(not torch.equal(after[n], v) for n, v in lora_before.items())


def test_exported_weights_are_peft_merged_weights(env, actor, tmp_path):
    """What the weight sync sends (export_hf_weights) is `W + (alpha / r) B @ A`: peft's merge_and_unload, within
    fp32 rounding (1e-6); the tied embedding, the norms and the head unchanged (bitwise).
    Mutation: `merged_weight` returns the parameter itself -> fails."""
    from rlhf_mcore.models import export_hf_weights
    from rlhf_mcore.models.lora import save_peft_adapter

    state, model_dir = env
    save_peft_adapter(actor.chunks, state, tmp_path / "adapter", actor.lora, str(model_dir))
    merged = peft_model(model_dir, tmp_path / "adapter").merge_and_unload().state_dict()
    ours = dict(export_hf_weights(actor.chunks, state))
    assert set(ours) <= set(merged) and "model.layers.1.self_attn.k_proj.weight" in ours
    for name, t in ours.items():
        if "proj" in name and name.endswith("weight"):
            torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=0, msg=name)
        else:
            assert torch.equal(t, merged[name]), name


def test_a_peft_made_adapter_loads_as_the_start(env, tmp_path):
    """`lora_adapter_path`: an adapter made by peft (random A and B, q/v/down only, so the fused QKV and the MLP are
    partly adapted) gives peft's log-probs. Mutation: `fuse` returns q's part where v's goes -> fails."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhf_mcore.trainer import roles

    state, model_dir = env
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    made = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False, lora_dropout=0.0))
    made.save_pretrained(tmp_path / "made")
    engine = roles.build_actor(config(model_dir, "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]",
                                      f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'made'}"), state, 2)
    batch = make_batch()
    ours, _ = engine.compute_log_probs(batch)
    torch.testing.assert_close(ours, hf_log_probs(peft_model(model_dir, tmp_path / "made"), batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, words", [
    (["actor_rollout_ref.model.target_modules=[q_proj,qkv]"], ["target_modules", "qkv", "all-linear"]),
    (["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora_adapter_path=/a"],
     ["lora_adapter_path", "lora_rank=0"]),
    (["critic.model.lora_alpha=0"], ["critic.model.lora_alpha", "> 0"]),
    (["actor_rollout_ref.actor.megatron.sequence_parallel=true"], ["sequence_parallel", "lora_rank > 0"]),
    (["actor_rollout_ref.rollout.lora_sync=adapter_only", "async_training.mode=one_step_off"],
     ["lora_sync", "adapter_only", "merged", "one_step_off", "broadcast"]),
    (["actor_rollout_ref.rollout.lora_sync=adapter_only", "actor_rollout_ref.rollout.sleep_level=2"],
     ["lora_sync", "merged", "sleep_level=2"]),
    (["actor_rollout_ref.rollout.lora_sync=adapter_only", "actor_rollout_ref.rollout.sync_verify=true"],
     ["lora_sync", "merged", "sync_verify"]),
    (["actor_rollout_ref.rollout.lora_sync=adapter_only", "actor_rollout_ref.model.lora_rank=0"],
     ["lora_sync", "merged", "lora_rank=0"]),
])
def test_bad_lora_configs_name_the_key_and_the_fix(tmp_path, overrides, words):
    from rlhf_mcore.config import ConfigError

    with pytest.raises(ConfigError) as e:
        config(tmp_path, *overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_an_adapter_of_another_rank_is_refused_with_both_values(env, actor, tmp_path):
    from rlhf_mcore.models.lora import LoraError, LoraSpec, read_peft_adapter, save_peft_adapter

    state, model_dir = env
    save_peft_adapter(actor.chunks, state, tmp_path / "a", actor.lora, str(model_dir))
    with pytest.raises(LoraError, match=r"r=4, lora_alpha=8.*lora_rank=8, lora_alpha=8.*set actor_rollout_ref"):
        read_peft_adapter(tmp_path / "a", LoraSpec(8, 8.0))
    with pytest.raises(LoraError, match="lora_adapter_path.*adapter_config.json"):
        read_peft_adapter(tmp_path, LoraSpec(4, 8.0))


def test_weight_sync_sends_the_merged_weights_to_the_native_rollout(env, actor, tmp_path):
    """`off` mode's sync (roles.sync_weights, what ColocatedRollout calls after every update): after an update the
    native engine holds peft's merge_and_unload weights (within fp32 rounding of the merge, 1e-6; the rest bitwise),
    verified by the sync's own checksums too.
    Mutation: `_gather_tp` sends `param.detach()` (the base) -> fails."""
    from rlhf_mcore.models.lora import save_peft_adapter
    from rlhf_mcore.rollout import build_rollout_engine
    from rlhf_mcore.sync import engine_hf_shards
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    batch = make_batch()
    old, _ = actor.compute_log_probs(batch)
    actor.update_policy({**batch, "old_log_probs": old})
    rollout = build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=16, load_weights=False)
    metrics = roles.sync_weights(actor, rollout, state, config(model_dir, "actor_rollout_ref.rollout.sync_verify=true")
                                 .actor_rollout_ref.rollout)
    assert metrics["sync/tensors"] > 0 and metrics["sync/verify_seconds"] > 0
    save_peft_adapter(actor.chunks, state, tmp_path / "adapter", actor.lora, str(model_dir))
    merged = peft_model(model_dir, tmp_path / "adapter").merge_and_unload().state_dict()
    held = engine_hf_shards(rollout)
    assert "model.layers.0.mlp.down_proj.weight" in held
    for name, shard in held.items():
        want = shard.expected_from(merged[name])
        if "proj" in name and name.endswith("weight"):
            torch.testing.assert_close(shard.tensor, want, atol=1e-6, rtol=0, msg=name)
        else:
            assert torch.equal(shard.tensor, want), name


def test_checkpoint_holds_the_adapters_and_resumes_bitwise(env, actor, tmp_path):
    """A LoRA checkpoint holds the adapters, their Adam state and the base's path and hash, nothing of the base;
    a fresh engine (other adapters) loaded from it takes the same next update bitwise. A different base is refused.
    Mutation: `load_trainable_state_dict` skips B (`if "lora_B" in name: continue`) -> fails."""
    from rlhf_mcore.engine.safe_load import load_common, tensor_keys
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    batch = make_batch()
    old, _ = actor.compute_log_probs(batch)
    actor.update_policy({**batch, "old_log_probs": old})  # Adam moments and step > 0
    actor.save_checkpoint(tmp_path / "ckpt")
    keys = tensor_keys(tmp_path / "ckpt")
    model_keys = {k for k in keys if not k.startswith("optimizer.")}
    assert len(model_keys) == 28 and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    assert any("exp_avg_sq" in k for k in keys)
    base = load_common(tmp_path / "ckpt")["lora_base"]
    assert base["path"] == str(model_dir) and len(base["sha256"]) == 64 and base["rank"] == RANK

    fresh = roles.build_actor(config(model_dir), state, total_steps=2)
    randomize_adapters(fresh.chunks, seed=5)
    fresh.load_checkpoint(tmp_path / "ckpt")
    for engine in (actor, fresh):
        lp, _ = engine.compute_log_probs(batch)
        engine.update_policy({**batch, "old_log_probs": lp})
    want, got = dict(actor.chunks[0].named_parameters()), dict(fresh.chunks[0].named_parameters())
    assert [n for n, p in want.items() if not torch.equal(got[n], p)] == []

    other = tmp_path / "other_base"
    other.mkdir()
    for f in model_dir.iterdir():
        (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    (other / "config.json").write_text((model_dir / "config.json").read_text() + "\n")  # another base's hash
    moved = roles.build_actor(config(other), state, total_steps=2)
    with pytest.raises(ValueError, match="trained on the base .*differs.*actor_rollout_ref.model.path"):
        moved.load_checkpoint(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------ TP=2 and PP=2 (one launch)
@pytest.fixture(scope="module")
def made_adapter(env, tmp_path_factory):
    """A peft-made all-linear adapter with random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, model_dir = env
    out = tmp_path_factory.mktemp("made_all")
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", init_lora_weights=False,
                                    lora_dropout=0.0)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def parallel_runs(env, made_adapter, tmp_path_factory):
    from launcher import CPU, run

    _, model_dir = env
    out = tmp_path_factory.mktemp("lora_parallel")
    torch.save(make_batch(), out / "batch.pt")
    run("tests/scripts/lora_cases.py", "--model-dir", str(model_dir), "--adapter", str(made_adapter), "--out",
        str(out), nproc=2, timeout=600, env_extra={**CPU, "PYTHONWARNINGS": "ignore"})
    return {name: torch.load(out / f"{name}.pt") for name in ("tp2", "pp2")}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tp2_and_pp2_equal_peft_and_tp1(env, made_adapter, parallel_runs, layout):
    """At TP=2 (A or B split as the base weight is, q/k/v per query group) and at PP=2: log-probs equal peft's
    (1e-5), the merged export equals peft's merge (1e-6), and one update moves the adapters as at TP=1 (1e-5); the
    TP=2 checkpoint loads at PP=2 bitwise. Mutation: drop the TP all-reduce of the row-parallel rank-r product
    (`region(u, ...)` skipped for row) -> tp2 fails; skip `copy_to_tensor_model_parallel_region` for column
    (A's gradient not summed over TP) -> tp2's update fails."""
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    res, batch = parallel_runs[layout], make_batch()
    peft = peft_model(model_dir, made_adapter)
    torch.testing.assert_close(res["log_probs"], hf_log_probs(peft, batch), atol=1e-5, rtol=0)
    merged = peft.merge_and_unload().state_dict()
    for name, t in res["merged"].items():
        torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=0, msg=name)
    from rlhf_mcore.models.lora import adapter_tensors

    tp1 = roles.build_actor(config(model_dir, f"actor_rollout_ref.model.lora_adapter_path={made_adapter}",
                                   "actor_rollout_ref.model.target_modules=all-linear"), state, 2)
    old, _ = tp1.compute_log_probs(batch)
    tp1.update_policy({**batch, "old_log_probs": old})
    want = adapter_tensors(tp1.chunks, state)
    assert set(want) == set(res["updated"])
    for name, t in res["updated"].items():
        torch.testing.assert_close(t, want[name], atol=1e-5, rtol=0, msg=name)
    if layout == "pp2":
        loaded, saved = res["loaded_from_tp2"], parallel_runs["tp2"]["updated"]
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)


# ------------------------------------------------------------------------------------ a LoRA run end to end
def test_one_step_off_lora_run_syncs_merged_weights_exports_and_converts(env, tmp_path):
    """launch/train.py with LoRA in `one_step_off` (1 rollout + 1 training process; the weights cross by broadcast)
    with `sync_verify`: every sync's rollout weights are checked bitwise against the merged export, the run ends
    with `lora_adapter/` (peft loads it) and `hf_final/` equal to peft's merge of it (1e-6), trained away from the
    base; convert_checkpoint's LoRA path turns the step-2 checkpoint into the same adapter (bitwise) and merged
    model. Mutation: `export_final` skips the PEFT directory -> fails; `lora_to_hf` skips `load_distributed` ->
    fails."""
    import importlib.util

    from e2e_helpers import parity_task, records
    from launcher import CPU
    from launcher import run as run_script
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    state, model_dir = env
    out = tmp_path / "run"
    args = parity_task(tmp_path, model_dir, max_response_length=6) + [
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=5e-3", "algorithm.adv_estimator=grpo", "trainer.max_rollout_logprob_gap=null",
        "actor_rollout_ref.rollout.sync_verify=true", "trainer.total_training_steps=2", "trainer.save_freq=2",
        "async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", f"trainer.default_local_dir={out}"]
    run_script("launch/train.py", *args, nproc=2, timeout=600, env_extra={**CPU, "PYTHONWARNINGS": "ignore"})
    assert [r["step"] for r in records(out)] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in records(out))
    merged = peft_model(model_dir, out / "lora_adapter").merge_and_unload().state_dict()
    final = AutoModelForCausalLM.from_pretrained(out / "hf_final", dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for name, t in final.items():
        torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=0, msg=name)
    assert (final["model.layers.0.self_attn.q_proj.weight"] - base["model.layers.0.self_attn.q_proj.weight"]
            ).abs().max() > 1e-4

    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "launch" / "convert_checkpoint.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    ckpt = convert.checked_model_dir(out / "checkpoints" / "global_step_2", None)
    convert.mcore_to_hf(ckpt, tmp_path / "conv_hf", state, out_adapter_dir=tmp_path / "conv_adapter")
    want = load_file(out / "lora_adapter" / "adapter_model.safetensors")
    got = load_file(tmp_path / "conv_adapter" / "adapter_model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    conv = AutoModelForCausalLM.from_pretrained(tmp_path / "conv_hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(conv[k], final[k]) for k in final)


def test_critic_lora_trains_adapters_and_its_value_head(env):
    """`critic.model.lora_rank`: the critic's trunk gets adapters, its value head trains in full (PEFT's
    modules_to_save), the rest is frozen; its checkpoint entries are exactly those. Mutation: drop the
    `output_layer.requires_grad_(True)` of apply_lora -> fails."""
    from rlhf_mcore.engine import build_engine
    from rlhf_mcore.models.lora import adapter_modules, trainable_sharded_state_dict

    state, model_dir = env
    critic = build_engine(config(model_dir, "algorithm.adv_estimator=gae", "critic.model.lora_rank=2",
                                 "critic.model.target_modules=[v_proj,o_proj]"), state, role="critic", total_steps=2)
    chunk = critic.chunks[0]
    trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
    assert {n for n in trainable if ".lora." not in n} == {"output_layer.weight", "output_layer.bias"}
    assert len(trainable) == 2 + 2 * 2 * 2 and len(list(adapter_modules([chunk]))) == 2 * 2
    assert set(trainable_sharded_state_dict(chunk)) >= {"output_layer.weight", "output_layer.bias"}
    values = critic.compute_values(make_batch())
    assert values.shape == (B, R) and values.abs().sum() > 0


def test_adapter_only_sync_leaves_the_rollout_with_the_merged_weights(env, actor):
    """The trainer's sync of a LoRA actor (roles.sync_weights) with `rollout.lora_sync=adapter_only`: full and merged
    the first time, adapter-only after (`sync.lora`: the adapters cross, the native engine's side merges them into
    its host copy of the base); the default (`merged`) sends every weight every time. The adapter-only engine ends
    with the merged sync's weights (1e-6, fp32 merge order) having received only the adapters' bytes.
    Mutation: `BaseWeights.merged` drops `scale` -> fails; `_adapter_only_sync` ignores `lora_sync` -> fails."""
    from rlhf_mcore.models.lora import adapter_tensors
    from rlhf_mcore.rollout import build_rollout_engine
    from rlhf_mcore.sync import engine_hf_shards
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    default = config(model_dir).actor_rollout_ref.rollout
    assert default.lora_sync == "merged"
    adapter_only = config(model_dir, "actor_rollout_ref.rollout.lora_sync=adapter_only").actor_rollout_ref.rollout
    merged_engine, adapter_engine = (build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=16,
                                                          load_weights=False) for _ in range(2))
    first = roles.sync_weights(actor, adapter_engine, state, adapter_only)
    assert "sync/adapter_bytes" not in first and first["sync/tensors"] > 2 * 7  # the first sync is full
    assert "sync/adapter_bytes" not in roles.sync_weights(actor, adapter_engine, state, default)  # merged: full
    batch = make_batch()
    old, _ = actor.compute_log_probs(batch)
    actor.update_policy({**batch, "old_log_probs": old})
    metrics = roles.sync_weights(actor, adapter_engine, state, adapter_only)
    assert "sync/adapter_bytes" not in roles.sync_weights(actor, merged_engine, state, default)
    adapters = adapter_tensors(actor.chunks, state)
    assert metrics["sync/adapter_bytes"] == sum(t.numel() * 4 for t in adapters.values())
    assert metrics["sync/load/tensors"] == 2 * 7
    want, got = engine_hf_shards(merged_engine), engine_hf_shards(adapter_engine)
    assert set(want) == set(got)
    for name in want:
        torch.testing.assert_close(got[name].tensor, want[name].tensor, atol=1e-6, rtol=0, msg=name)


class _Loopback:
    """Both ends of the asynchronous trainers' weights link in one process: the sending end queues what it
    broadcasts, the receiving end takes it back in order (rlhf_mcore.sync.broadcast's comm protocol)."""

    def __init__(self, queue, sending: bool):
        self.queue, self.sending, self.device = queue, sending, torch.device("cpu")

    def broadcast(self, tensor, src):
        if self.sending:
            self.queue.append(tensor.clone())
        else:
            tensor.copy_(self.queue.popleft())

    def broadcast_object(self, obj, src):
        if self.sending:
            self.queue.append(obj)
            return obj
        return self.queue.popleft()


def test_async_modes_weight_push_leaves_the_rollout_pool_with_the_merged_weights(env, actor, tmp_path):
    """`one_step_off` and `fully_async` (veRL #7495: the adapter never reached the rollout in async mode): the
    training pool's push (TrainingPool.push_weights) into a rollout worker's engine (RolloutWorker.receive_weights),
    over a loopback link, after an update: the engine holds peft's merge_and_unload weights (1e-6 for the merged
    linears, the rest bitwise). With `sync_verify` the receiver reads its engine back: an engine that drops a tensor
    is named. Mutation: push_weights exports inside `adapters_disabled` (the base crosses) -> fails; receive_weights
    without the EngineVerifier -> the dropped tensor passes unseen, fails."""
    from collections import deque
    from types import SimpleNamespace

    from rlhf_mcore.models.lora import save_peft_adapter
    from rlhf_mcore.rollout import build_rollout_engine
    from rlhf_mcore.sync import WeightSyncError, engine_hf_shards
    from rlhf_mcore.trainer.rollout_worker import RolloutWorker
    from rlhf_mcore.trainer.training_pool import TrainingPool

    state, model_dir = env
    cfg = config(model_dir, "actor_rollout_ref.rollout.sync_verify=true")
    batch = make_batch()
    old, _ = actor.compute_log_probs(batch)
    actor.update_policy({**batch, "old_log_probs": old})
    link = deque()

    def push_and_receive(engine):
        pool = TrainingPool(SimpleNamespace(cfg=cfg, state=state), SimpleNamespace(
            layout=SimpleNamespace(rollout_ranks=[]), mailbox=lambda name: None, weights=_Loopback(link, True)), [[0]])
        pool.push_weights(actor, version=1)
        worker = SimpleNamespace(cfg=cfg, engine=engine, pools=SimpleNamespace(weights=_Loopback(link, False)),
                                 staged=None)  # no background receive pending (prefetch_weights off)
        RolloutWorker.receive_weights(worker, 1)
        assert not link and worker.version == 1

    rollout = build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=16, load_weights=False)
    push_and_receive(rollout)
    save_peft_adapter(actor.chunks, state, tmp_path / "adapter", actor.lora, str(model_dir))
    merged = peft_model(model_dir, tmp_path / "adapter").merge_and_unload().state_dict()
    held = engine_hf_shards(rollout)
    assert "model.layers.1.self_attn.q_proj.weight" in held
    for name, shard in held.items():
        if "proj" in name and name.endswith("weight"):
            torch.testing.assert_close(shard.tensor, merged[name], atol=1e-6, rtol=0, msg=name)
        else:
            assert torch.equal(shard.tensor, merged[name]), name

    lossy = build_rollout_engine("native", model_dir, max_num_seqs=2, max_model_len=16, load_weights=False)
    load = lossy.update_weights
    lossy.update_weights = lambda group: load([(n, t) for n, t in group if n != "model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(WeightSyncError, match="model.layers.0.mlp.up_proj.weight"):
        push_and_receive(lossy)
    link.clear()


def test_lora_turns_the_train_engines_cuda_graphs_off(env, actor):
    """A captured decoder graph would not see the reference pass switch the adapters off: with LoRA the graphs are
    off, and asking for them is refused with the key. Mutation: drop the `cuda_graphs=False` replace -> fails."""
    from rlhf_mcore.trainer import roles

    state, model_dir = env
    assert actor.cfg.cuda_graphs is False and actor._graphs == []
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.megatron.cuda_graphs=true with LoRA"):
        roles.build_actor(config(model_dir, "actor_rollout_ref.actor.megatron.cuda_graphs=true"), state, 2)


# ------------------------------------------------------------------------------------ the adapted linear's GEMMs
class _Ops(__import__("torch.utils._python_dispatch", fromlist=["TorchDispatchMode"]).TorchDispatchMode):
    """Records every aten op run inside it (forward or backward) with its output's element count."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.__name__.split(".")[0], out.numel() if isinstance(out, torch.Tensor) else 0, args))
        return out


def _shape(**kw):
    from rlhf_mcore.models.hf_config import ModelShape

    base = dict(family="qwen2", num_layers=1, hidden_size=16, num_attention_heads=8, num_kv_heads=2, head_dim=4,
                ffn_hidden_size=12, vocab_size=50, max_position_embeddings=64, rms_norm_eps=1e-6,
                tie_word_embeddings=False, qkv_bias=True, qk_norm=False, rope_theta=1e4)
    return ModelShape(**{**base, **kw})


def _adapters(kind, targets, shape, seed=0):
    """LoraAdapters of one fused linear (TP=1) with random A and B, as apply_lora builds them."""
    from rlhf_mcore.models.lora import _LINEARS, LoraAdapters, _part_shapes

    parts = next(p for k, p in _LINEARS.values() if k == kind or (kind == "o" and p[0][1] == "o_proj"))
    lora = LoraAdapters("row" if kind == "o" else kind, _part_shapes("row" if kind == "o" else kind, parts, shape, 1,
                                                                    targets), RANK, ALPHA / RANK, None, 1, shape,
                        torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in lora.A:
        lora.A[t].data.copy_(torch.randn(lora.A[t].shape, generator=g))
        lora.B[t].data.copy_(torch.randn(lora.B[t].shape, generator=g))
    return lora


def _naive_fused(lora, x, shape):
    """The pre-issue-35 formula, written out: each adapted part's `x A^T B^T * scale`, placed in the fused weight's
    row order by an explicit loop (per query group: its q heads, its k head, its v head; gate then up); parts that
    are not adapted contribute zeros."""
    part = {t: (x @ lora.A[t].t() @ lora.B[t].t()) * lora.scale for t in lora.A}
    zero = {t: torch.zeros(*x.shape[:-1], w) for t, w in lora.widths.items()}
    get = {**zero, **part}
    if lora.kind == "row":
        return get["o_proj"] if "o_proj" in get else get["down_proj"]
    if lora.kind == "fc1":
        return torch.cat([get["gate_proj"], get["up_proj"]], dim=-1)
    hd, qpg = shape.head_dim, shape.num_attention_heads // shape.num_kv_heads
    cols = []
    for grp in range(shape.num_kv_heads):
        cols += [get["q_proj"][..., grp * qpg * hd:(grp + 1) * qpg * hd], get["k_proj"][..., grp * hd:(grp + 1) * hd],
                 get["v_proj"][..., grp * hd:(grp + 1) * hd]]
    return torch.cat(cols, dim=-1)


@pytest.mark.parametrize("kind, targets", [
    ("qkv", ("q_proj", "k_proj", "v_proj")), ("qkv", ("q_proj", "v_proj")), ("fc1", ("gate_proj", "up_proj")),
    ("fc1", ("up_proj",)), ("o", ("o_proj",))])
def test_stacked_lora_linear_equals_the_naive_per_part_formula(kind, targets):
    """`lora_linear` with `LoraAdapters.stacked` (A stacked, one block B with the scale folded in, GQA's q/k/v
    interleave) equals the base plus each part's `x A^T B^T * scale` in the fused row order, forward and every
    gradient (x, each A, each B) to fp32 rounding; `delta_weight` is the fused `scale * B A`.
    Mutation: `stacked` puts v's block before k's in each query group -> the qkv cases fail; drop `* self.scale` ->
    every case fails; `dx.addmm_(du, a)` dropped in the backward -> every case fails."""
    from rlhf_mcore.models.lora_linear import lora_linear

    shape = _shape()
    lora = _adapters(kind, targets, shape)
    a, bs = lora.stacked()
    out_w, in_w = bs.shape[0], a.shape[1]
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(out_w, in_w, generator=g), torch.randn(out_w, generator=g) if kind == "qkv" else None
    x = torch.randn(6, 1, in_w, generator=g)
    weights = torch.randn(6, 1, out_w, generator=g)

    def grads(fn):
        xi = x.clone().requires_grad_(True)
        for p in lora.parameters():
            p.grad = None
        y = fn(xi)
        (y * weights).sum().backward()
        return y.detach(), xi.grad, {n: p.grad.clone() for n, p in lora.named_parameters()}

    y, dx, dp = grads(lambda xi: lora_linear(xi, w, bias, *lora.stacked()))
    base = lambda xi: xi @ w.t() + (bias if bias is not None else 0)  # noqa: E731
    y0, dx0, dp0 = grads(lambda xi: base(xi) + _naive_fused(lora, xi, shape))
    torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx0, atol=1e-5, rtol=1e-5)
    assert set(dp) == set(dp0) and len(dp) == 2 * len(targets)
    for n in dp:
        torch.testing.assert_close(dp[n], dp0[n], atol=1e-4, rtol=1e-5, msg=n)
    eye = torch.eye(in_w)
    torch.testing.assert_close(lora.delta_weight(), _naive_fused(lora, eye, shape).t(), atol=1e-5, rtol=1e-5)


def test_lora_linear_is_gemms_only():
    """The adapted linear (fc1, both parts) runs no activation-sized op but its GEMMs and views, forward and
    backward: no add, scale, cat or zero block over the tokens (what issue 35's profile showed), no batched GEMM.
    Mutation: `out = out + u @ bs.t()` in place of `out.addmm_(u, bs.t())` -> fails (an activation-sized `add`)."""
    from rlhf_mcore.models.lora_linear import lora_linear

    lora = _adapters("fc1", ("gate_proj", "up_proj"), _shape())
    tokens = 64
    x = torch.randn(tokens, 1, 16, requires_grad=True)
    w, grad = torch.randn(24, 16), torch.randn(tokens, 1, 24)
    with _Ops() as rec:
        y = lora_linear(x, w, None, *lora.stacked())
        torch.autograd.backward(y, grad)
    assert x.grad is not None and all(p.grad is not None for p in lora.parameters())
    gemm_or_view = {"mm", "addmm_", "view", "_unsafe_view", "reshape", "t", "transpose", "detach"}
    big = [(name, n) for name, n, _ in rec.ops if n >= tokens * 16 and name not in gemm_or_view]
    assert big == [], big
    assert "bmm" not in {name for name, _, _ in rec.ops}


def test_frozen_head_input_gradient_is_one_gemm_equal_to_autograds():
    """A frozen LM head's input gradient arrives as GPTModel's `logits.transpose(0, 1).contiguous()` makes it,
    (s, 1, V) with strides (V, s V, 1); torch's matmul with a frozen weight does not fold that into one GEMM (it ran
    one per token on the H200). `frozen_linear`: the same forward, a backward of one `mm` over all tokens equal to
    autograd's reference. Mutation: the backward as Megatron's `g.matmul(weight)` -> a `bmm` of s products, fails."""
    from rlhf_mcore.models.lora_linear import frozen_linear

    g = torch.Generator().manual_seed(0)
    s, h, v = 9, 8, 40
    w, x0 = torch.randn(v, h, generator=g), torch.randn(s, 1, h, generator=g)
    weights = torch.randn(1, s, v, generator=g)

    def run(fn):
        x = x0.clone().requires_grad_(True)
        logits = fn(x).transpose(0, 1).contiguous()
        with _Ops() as rec:
            torch.autograd.backward(logits, weights)
        return logits.detach(), x.grad, [name for name, _, _ in rec.ops]

    y, dx, ops = run(lambda x: frozen_linear(x, w))
    y0, dx0, _ = run(lambda x: x @ w.t())
    assert torch.equal(y, y0)
    torch.testing.assert_close(dx, dx0, atol=1e-5, rtol=1e-6)
    assert "bmm" not in ops and ops.count("mm") == 1, ops


def test_lora_update_runs_no_batched_gemm_over_the_vocabulary(env, actor):
    """In a LoRA update every frozen linear runs through `lora_linear.frozen_impl` (the LM head included): no
    batched GEMM with a vocabulary-sized operand in the whole update, forward and backward.
    Mutation: apply_lora installs `frozen_impl` on adapted linears only (the head keeps Megatron's frozen linear)
    -> fails."""
    chunk = actor.chunks[0]
    vocab = chunk.shared_embedding_or_output_weight().shape[0]
    batch = make_batch()
    old, _ = actor.compute_log_probs(batch)
    with _Ops() as rec:
        actor.update_policy({**batch, "old_log_probs": old})
    bmm = [[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)] for name, _, args in rec.ops
           if name in ("bmm", "baddbmm")]
    assert not [shapes for shapes in bmm if any(vocab in sh for sh in shapes)], bmm
    assert rec.ops and sum(name == "mm" for name, _, _ in rec.ops) > 0
