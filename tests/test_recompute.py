"""Activation recompute's layout (`megatron.override_transformer_config.recompute_method / recompute_num_layers`,
with `model.enable_gradient_checkpointing=true`): which layers run twice, and the update they give."""
import pytest
import torch

pytestmark = pytest.mark.cost(25)

LAYERS = 4


@pytest.fixture(scope="module")
def state(cpu_only):
    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    s = init_distributed(device="cpu")
    yield s
    destroy_distributed()


def config(model_dir, *extra):
    from rlhf_mcore.config import load_config

    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu",
                              "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.train_batch_size=8",
                              *extra])


def forwards_per_layer(engine, batch) -> tuple[list[int], dict]:
    """How many times each decoder layer ran its forward in one `update_policy` (and the update's metrics)."""
    layers = engine.chunks[0].decoder.layers
    counts = [0] * len(layers)
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
             for i, layer in enumerate(layers)]
    try:
        metrics = engine.update_policy(batch)
    finally:
        for h in hooks:
            h.remove()
    return counts, metrics


@pytest.mark.parametrize("keys, runs", [
    ((), [1] * LAYERS),  # no recompute: one forward per micro-batch
    (("enable_gradient_checkpointing=true",), [2] * LAYERS),  # the default: every layer again in the backward
    (("enable_gradient_checkpointing=true", "method=uniform", "num_layers=2"), [2] * LAYERS),
    (("enable_gradient_checkpointing=true", "method=block", "num_layers=1"), [2, 1, 1, 1]),
    (("enable_gradient_checkpointing=true", "method=block", "num_layers=3"), [2, 2, 2, 1]),
], ids=["off", "default", "uniform2", "block1", "block3"])
def test_the_layers_that_run_twice_and_the_same_update(tiny_model_dir, state, keys, runs):
    """Each layer's forward count in one update (2 micro-batches) follows the method: block recomputes only its
    first N layers. The update equals the one without recompute (fp32 on CPU: bitwise). Mutations: build_engine
    dropping the two keys (recompute_overrides(recompute) as before) -> block1 and block3 fail (every layer
    twice); recompute_overrides ignoring `method` -> the same."""
    from test_train_cuda_graphs import rl_batch

    from rlhf_mcore.engine import build_engine

    model_dir = tiny_model_dir(arch="qwen2", vocab=512, layers=LAYERS, hidden=64, heads=4, kv_heads=2,
                               intermediate=128, init_std=0.02)
    prefix = {"enable_gradient_checkpointing": "actor_rollout_ref.model.",
              "method": "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_",
              "num_layers": "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_"}
    overrides = [prefix[k.split("=")[0]] + k for k in keys]
    results = {}
    for name, extra in (("plain", []), ("case", overrides)):
        torch.manual_seed(0)
        engine = build_engine(config(model_dir, *extra), state, role="actor")
        counts, metrics = forwards_per_layer(engine, rl_batch(8, 512, "cpu"))
        results[name] = (counts, metrics, [p.detach().clone() for p in engine.chunks[0].parameters()])
    counts, metrics, params = results["case"]
    micro_batches = 2
    assert counts == [r * micro_batches for r in runs], counts
    assert results["plain"][0] == [micro_batches] * LAYERS
    assert metrics["actor/pg_loss"] == results["plain"][1]["actor/pg_loss"]
    assert metrics["actor/grad_norm"] == results["plain"][1]["actor/grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(params, results["plain"][2]))
