"""Activation recompute's layout (`megatron.override_transformer_config.recompute_method / recompute_num_layers`,
with `model.enable_gradient_checkpointing=true`): which layers run twice, and the update they give."""
import pytest
import torch

pytestmark = pytest.mark.cost(25)

LAYERS = 4


@pytest.fixture(scope="module")
def state(cpu_state):
    return cpu_state


def config(model_dir, *extra):
    from rlhf_mcore.config import load_config

    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu",
                              "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.train_batch_size=8",
                              *extra])


def forwards_per_layer(engine, batch) -> tuple[list[int], list[int], dict]:
    """How many times each decoder layer, and each layer's core attention, ran its forward in one `update_policy`
    (and the update's metrics)."""
    layers = engine.chunks[0].decoder.layers
    counts, attn = [0] * len(layers), [0] * len(layers)
    hooks = [m.register_forward_pre_hook(lambda mod, a, i=i, c=c: c.__setitem__(i, c[i] + 1))
             for c, mods in ((counts, layers), (attn, [la.self_attention.core_attention for la in layers]))
             for i, m in enumerate(mods)]
    try:
        metrics = engine.update_policy(batch)
    finally:
        for h in hooks:
            h.remove()
    return counts, attn, metrics


@pytest.mark.parametrize("keys, runs, attn_runs", [
    ((), [1] * LAYERS, [1] * LAYERS),  # no recompute: one forward per micro-batch
    (("enable_gradient_checkpointing=true",), [2] * LAYERS, [2] * LAYERS),  # every layer again in the backward
    (("granularity=full",), [2] * LAYERS, [2] * LAYERS),  # veRL's megatron way to say the same
    (("enable_gradient_checkpointing=true", "method=uniform", "num_layers=2"), [2] * LAYERS, [2] * LAYERS),
    (("enable_gradient_checkpointing=true", "method=block", "num_layers=1"), [2, 1, 1, 1], [2, 1, 1, 1]),
    (("granularity=full", "method=block", "num_layers=3"), [2, 2, 2, 1], [2, 2, 2, 1]),
    (("granularity=selective",), [1] * LAYERS, [2] * LAYERS),  # only the core attention again (recompute_modules)
], ids=["off", "default", "full", "uniform2", "block1", "block3", "selective"])
def test_the_layers_that_run_twice_and_the_same_update(tiny_model_dir, state, keys, runs, attn_runs):
    """Each layer's (and its core attention's) forward count in one update (2 micro-batches) follows the keys:
    block recomputes only its first N layers, selective only the core attention. The update equals the one without
    recompute (fp32 on CPU: bitwise). Mutations: build_engine dropping method / num_layers (recompute_overrides(
    recompute) as before) -> block1 and block3 fail (every layer twice); recompute_overrides ignoring `method` ->
    the same; `recompute_mode` ignoring recompute_granularity -> full, block3 and selective fail."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.engine import build_engine

    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=LAYERS, hidden=64, heads=4, kv_heads=2,
                               intermediate=128, init_std=0.02)
    otc = "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_"
    overrides = [("actor_rollout_ref.model." if k.startswith("enable_") else otc) + k for k in keys]
    results = {}
    for name, extra in (("plain", []), ("case", overrides)):
        torch.manual_seed(0)
        engine = build_engine(config(model_dir, *extra), state, role="actor")
        counts, attn, metrics = forwards_per_layer(engine, rl_batch(8, 512, "cpu"))
        results[name] = (counts, attn, metrics, [p.detach().clone() for p in engine.chunks[0].parameters()])
    counts, attn, metrics, params = results["case"]
    micro_batches = 2
    assert counts == [r * micro_batches for r in runs], counts
    assert attn == [r * micro_batches for r in attn_runs], attn
    assert results["plain"][0] == [micro_batches] * LAYERS
    plain = results["plain"][2]
    assert metrics["actor/pg_loss"] == plain["actor/pg_loss"]
    assert metrics["actor/grad_norm"] == plain["actor/grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(params, results["plain"][3]))
