"""Policy/value/entropy losses and loss aggregation against naive per-element references.

The references are Python loops over scalar tensors (so autograd gives reference gradients too). The
micro-batch tests split a batch into chunks, give each chunk the global token/sequence counts, and check
that the chunk losses and gradients sum to the whole-batch ones, for every aggregation mode.
"""
import math
import random

import pytest
import torch

from rlhf_mcore.algos import (
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss,
    list_loss_agg_modes,
    list_policy_losses,
    register_policy_loss,
)

F64 = torch.float64  # tests run in float64 so references agree to ~1e-12; the functions are dtype-generic


def ref(x):
    return torch.as_tensor(x, dtype=F64)


def make_batch(seed: int, B: int = 7, T: int = 6):
    """Random right-padded batch with an all-masked row and a length-1 row."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(1, T) for _ in range(B)]
    lengths[0], lengths[1] = 0, 1
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    new = old + torch.randn(B, T, generator=g, dtype=F64) * 0.4  # ratios ~0.3 to ~3: all clip branches occur
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return old, new, adv, mask, lengths


# --------------------------------------------------------------------------------------------- references


def naive_agg(loss, mask, mode, scale=None):
    """Aggregate a (B, T) loss with explicit loops over rows and tokens."""
    B, T = mask.shape
    if mode == "token-mean":
        terms = [loss[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
        return sum(terms) / max(len(terms), 1)
    seq_terms = []
    for i in range(B):
        toks = [loss[i][t] for t in range(T) if mask[i, t] > 0]
        if not toks:
            continue
        if mode == "seq-mean-token-sum":
            seq_terms.append(sum(toks))
        elif mode == "seq-mean-token-mean":
            seq_terms.append(sum(toks) / len(toks))
        elif mode == "seq-mean-token-sum-norm":
            seq_terms.append(sum(toks) / (T if scale is None else scale))
    return sum(seq_terms) / max(len(seq_terms), 1)


def naive_ppo_token(old, new, a, low, high, c):
    ratio = torch.exp(torch.clamp(new - old, -20, 20))
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    loss = torch.maximum(-a * ratio, -a * clipped_ratio)
    clipped = bool(-a * clipped_ratio > -a * ratio)
    lower = False
    if a < 0:
        lower = bool(loss > -a * c)
        loss = torch.minimum(loss, -a * c)
    return loss, clipped, lower


# --------------------------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode", list_loss_agg_modes())
@pytest.mark.parametrize("seed", [0, 1])
def test_agg_loss_matches_naive_loops(mode, seed):
    _, new, adv, mask, _ = make_batch(seed)
    loss_mat = new * adv
    loss_mat = torch.where(mask.bool(), loss_mat, torch.full_like(loss_mat, float("inf")))
    torch.testing.assert_close(agg_loss(loss_mat, mask, mode), ref(naive_agg(loss_mat, mask, mode)))
    torch.testing.assert_close(
        agg_loss(loss_mat, mask, mode, loss_scale_factor=10.0), ref(naive_agg(loss_mat, mask, mode, 10.0))
    )


@pytest.mark.parametrize("mode", list_loss_agg_modes())
def test_agg_loss_of_an_empty_batch_is_zero_not_nan(mode):
    assert agg_loss(torch.randn(3, 4), torch.zeros(3, 4), mode).item() == 0.0


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-sum")


def split_trimmed(tensors, mask, sizes):
    """Split rows into chunks of `sizes`, each trimmed to its own longest response (as a packer would)."""
    chunks, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        width = max(int(mask[rows].sum(-1).max().item()), 1)
        chunks.append([t[rows, :width] for t in tensors] + [mask[rows, :width]])
        start += size
    return chunks


@pytest.mark.parametrize("mode", list_loss_agg_modes())
@pytest.mark.parametrize("loss_name", ["vanilla", "gspo"])
def test_micro_batches_with_global_normaliser_sum_to_whole_batch_loss_and_grad(mode, loss_name):
    old, new, adv, mask, _ = make_batch(3, B=9, T=6)
    T = mask.shape[1]
    loss_fn = get_policy_loss(loss_name)
    common = dict(loss_agg_mode=mode, clip_ratio=0.2, clip_ratio_high=0.28, loss_scale_factor=T)

    whole_new = new.clone().requires_grad_(True)
    whole, _ = loss_fn(old, whole_new, adv, mask, **common)
    whole.backward()

    global_tokens = mask.sum()
    global_seqs = (mask.sum(-1) > 0).sum()
    parts_new = new.clone().requires_grad_(True)
    total = 0.0
    start = 0
    for size in [2, 3, 1, 3]:
        rows = slice(start, start + size)
        width = max(int(mask[rows].sum(-1).max().item()), 1)
        part, _ = loss_fn(
            old[rows, :width], parts_new[rows, :width], adv[rows, :width], mask[rows, :width],
            global_tokens=global_tokens, global_seqs=global_seqs, **common,
        )
        part.backward()
        total = total + part.detach()
        start += size
    torch.testing.assert_close(total, whole.detach())
    torch.testing.assert_close(parts_new.grad, whole_new.grad)


@pytest.mark.parametrize("mode", list_loss_agg_modes())
def test_agg_loss_chunks_sum_to_whole(mode):
    _, new, adv, mask, _ = make_batch(4, B=8)
    loss_mat = new * adv
    whole = agg_loss(loss_mat, mask, mode, loss_scale_factor=6)
    chunks = split_trimmed([loss_mat], mask, [3, 1, 4])
    total = sum(
        agg_loss(lm, m, mode, global_tokens=int(mask.sum()), global_seqs=int((mask.sum(-1) > 0).sum()),
                 loss_scale_factor=6)
        for lm, m in chunks
    )
    torch.testing.assert_close(total, whole)
    # Without the global counts a chunk normalises by itself: the sum differs (the check can fail).
    local_total = sum(agg_loss(lm, m, mode, loss_scale_factor=6) for lm, m in chunks)
    assert not torch.isclose(local_total, whole)


# --------------------------------------------------------------------------------------------- policy losses


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", list_loss_agg_modes())
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 1.5), (0.1, 0.5, 10.0)])
def test_vanilla_ppo_matches_naive_loop(seed, mode, low, high, c):
    old, new, adv, mask, _ = make_batch(seed)
    new_a = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("vanilla")(
        old, new_a, adv, mask, loss_agg_mode=mode, clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=c,
    )
    loss.backward()

    new_b = new.clone().requires_grad_(True)
    B, T = mask.shape
    grid = [[torch.zeros(()) for _ in range(T)] for _ in range(B)]
    n_tok = n_clip = n_lower = 0
    kl_sum = 0.0
    for i in range(B):
        for t in range(T):
            if mask[i, t] == 0:
                continue
            grid[i][t], clipped, lower = naive_ppo_token(old[i, t], new_b[i, t], adv[i, t], low, high, c)
            n_tok += 1
            n_clip += clipped
            n_lower += lower
            kl_sum += float(old[i, t] - new[i, t])
    ref = naive_agg(grid, mask, mode)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(new_a.grad, new_b.grad)
    assert metrics["pg_clipfrac"].item() == pytest.approx(n_clip / n_tok)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(n_lower / n_tok)
    assert metrics["ppo_kl"].item() == pytest.approx(kl_sum / n_tok)
    assert 0 < n_clip < n_tok  # the batch really exercises clipping


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_garbage_in_padding_does_not_leak_into_the_loss(name):
    old, new, adv, mask, _ = make_batch(2)
    poisoned_old = torch.where(mask.bool(), old, torch.full_like(old, float("nan")))
    poisoned_adv = torch.where(mask.bool(), adv, torch.full_like(adv, float("inf")))
    clean, _ = get_policy_loss(name)(old, new, adv, mask)
    dirty, metrics = get_policy_loss(name)(poisoned_old, new, poisoned_adv, mask)
    torch.testing.assert_close(dirty, clean)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_vanilla_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[10.0, 10.0]]))  # ratio 10, far off-policy
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, m = get_policy_loss("vanilla")(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum", clip_ratio_c=3.0)
    # Token 0 (A<0): -A*r = 10 is capped at -A*c = 3; token 1 (A>0): max(-10, -1.2) = -1.2.
    assert loss.item() == pytest.approx(3.0 - 1.2)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(old, new, adv, mask, clip_ratio_c=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_sequence_level_reference(seed):
    """veRL's token-level GSPO equals the sequence-level objective -A_i * clip(s_i) when A is per-sequence."""
    old, new, _, mask, lengths = make_batch(seed)
    B, T = mask.shape
    seq_adv = torch.randn(B, generator=torch.Generator().manual_seed(seed + 10), dtype=F64)
    adv = seq_adv[:, None].expand(B, T).clone()
    low, high = 0.1, 0.15
    new_a = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("gspo")(
        old, new_a, adv, mask, clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode="token-mean"
    )
    loss.backward()

    new_b = new.clone().requires_grad_(True)
    seq_losses, n_clip_tokens = [], 0
    for i in range(B):
        n = lengths[i]
        if n == 0:
            continue
        log_s = sum(new_b[i, t] - old[i, t] for t in range(n)) / n
        s = torch.exp(torch.clamp(log_s, max=10.0))
        a = seq_adv[i]
        l_un, l_cl = -a * s, -a * torch.clamp(s, 1 - low, 1 + high)
        seq_losses.append(torch.maximum(l_un, l_cl))
        n_clip_tokens += n * bool(l_cl > l_un)
    ref = sum(seq_losses) / len(seq_losses)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(new_a.grad, new_b.grad)
    assert metrics["pg_clipfrac"].item() == pytest.approx(n_clip_tokens / mask.sum().item())


def naive_gspo_token(old_i, new_i, t, a, w, low, high):
    """GSPO's loss at token t of one sequence (its valid tokens' log-probs `old_i`, `new_i`), from scalars:
    s_i = exp(mean_t(new - old)) (capped at exp(10)), the token's ratio s_i,t = sg(s_i) * exp(new_t - sg(new_t)),
    PPO clipping of s_i,t against the token's advantage `a`, times its IS weight `w`. Returns (loss, clipped)."""
    log_s = sum(n - o for n, o in zip(new_i, old_i)) / len(new_i)
    token_log_ratio = new_i[t] - new_i[t].detach() + log_s.detach()
    s_t = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped, clipped = -a * s_t, -a * torch.clamp(s_t, 1 - low, 1 + high)
    return torch.maximum(unclipped, clipped) * w, bool(clipped > unclipped)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_matches_naive_per_token_loop(seed, weighted):
    """GSPO with per-token advantages (GAE's) and per-token rollout IS weights: the loss and the gradient of every
    token's log-prob equal a loop over tokens of `naive_gspo_token`, aggregated seq-mean-token-mean. One row's
    sequence log-ratio is past the exp(10) cap (no gradient through it).

    Mutation: in compute_policy_loss_gspo, `ratio = masked_mean(ratio, response_mask, dim=-1).unsqueeze(-1)
    .expand_as(ratio)` (the per-token ratios replaced by their mean: same values, other gradients) -> fails, as
    does `pg_losses * masked_mean(rollout_is_weights, response_mask)` (weighted); today's other GSPO tests pass
    both."""
    old, new, adv, mask, lengths = make_batch(seed)
    new = old + 0.3 * (new - old)  # sequence ratios ~0.85 to ~1.15: tokens on both sides of the clip range
    new[3] += 12.0  # mean log-ratio > 10: the cap
    B, T = mask.shape
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 20), dtype=F64) + 0.5 if weighted else None
    low, high = 0.05, 0.08
    new_a = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("gspo")(old, new_a, adv, mask, clip_ratio_low=low, clip_ratio_high=high,
                                            loss_agg_mode="token-mean", rollout_is_weights=w)
    loss.backward()

    new_b = new.clone().requires_grad_(True)
    seq_losses, n_clip = [], 0
    for i in range(B):
        n = lengths[i]
        if n == 0:
            continue
        old_i, new_i = [old[i, t] for t in range(n)], [new_b[i, t] for t in range(n)]
        terms = []
        for t in range(n):
            term, clipped = naive_gspo_token(old_i, new_i, t, adv[i, t], 1.0 if w is None else w[i, t], low, high)
            terms.append(term)
            n_clip += clipped
        seq_losses.append(sum(terms) / n)
    expected = sum(seq_losses) / len(seq_losses)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(new_a.grad, new_b.grad)
    assert metrics["pg_clipfrac"].item() == pytest.approx(n_clip / mask.sum().item())
    assert 0 < n_clip < mask.sum().item()  # both branches occur
    assert lengths[3] > 1 and (new_b.grad[3] == 0).all()  # the cap stops the gradient
    assert (new_b.grad.abs().sum(1) > 0).sum() >= 2  # rows with tokens inside the clip range


def test_policy_loss_registry():
    assert {"vanilla", "gspo"} <= set(list_policy_losses())
    with pytest.raises(ValueError, match="known: .*vanilla"):
        get_policy_loss("ppo2")

    @register_policy_loss("test_reinforce")
    def reinforce(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", **_):
        return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), {}

    old, new, adv, mask, _ = make_batch(0)
    loss, _ = get_policy_loss("test_reinforce")(old, new, adv, mask, clip_ratio=0.2, unrelated=1)
    torch.testing.assert_close(loss, ref(naive_agg(-adv * new, mask, "token-mean")))


def test_rollout_is_weights_scale_token_losses():
    old, new, adv, mask, _ = make_batch(1)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    fn = get_policy_loss("vanilla")
    weighted, _ = fn(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum", rollout_is_weights=weights)
    B, T = mask.shape
    grid = [[naive_ppo_token(old[i, t], new[i, t], adv[i, t], 0.2, 0.2, 3.0)[0] * weights[i, t] if mask[i, t] else 0
             for t in range(T)] for i in range(B)]
    torch.testing.assert_close(weighted, ref(naive_agg(grid, mask, "seq-mean-token-sum")))


# --------------------------------------------------------------------------------------------- value, entropy


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_naive_loop(seed, mode):
    _, vpreds, returns, mask, _ = make_batch(seed)
    values = vpreds + torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * 0.6
    c = 0.3
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=c, loss_agg_mode=mode)
    B, T = mask.shape
    grid = [[0.0] * T for _ in range(B)]
    n_clip = 0
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                v, r, v_old = float(vpreds[i, t]), float(returns[i, t]), float(values[i, t])
                v_clip = min(max(v, v_old - c), v_old + c)
                grid[i][t] = max((v - r) ** 2, (v_clip - r) ** 2)
                n_clip += (v_clip - r) ** 2 > (v - r) ** 2
    torch.testing.assert_close(loss, ref(0.5 * naive_agg(grid, mask, mode)))
    assert metrics["vf_clipfrac"].item() == pytest.approx(n_clip / mask.sum().item())
    assert 0 < n_clip


def test_entropy_matches_naive_sum_and_bonus_sign():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 5, generator=g, dtype=F64) * 4
    logits[0, 0] += 1000.0  # large logits stay finite
    ent = entropy_from_logits(logits)
    for i in range(3):
        for t in range(4):
            z = [float(x) for x in logits[i, t]]
            mx = max(z)
            p = [math.exp(x - mx) for x in z]
            p = [x / sum(p) for x in p]
            assert ent[i, t].item() == pytest.approx(-sum(x * math.log(x) for x in p if x > 0), abs=1e-9)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    term, metrics = compute_entropy_loss(ent, mask, entropy_coeff=0.01)
    expected = (ent[0, 0] + ent[0, 1] + ent[1, 0]) / 3
    torch.testing.assert_close(metrics["entropy"], expected)
    torch.testing.assert_close(term, -0.01 * expected)


def test_sft_loss_is_token_mean_nll_and_microbatch_invariant():
    from rlhf_mcore.algos import get_policy_loss

    torch.manual_seed(0)
    lp = -torch.rand(4, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]).float()
    fn = get_policy_loss("sft")
    loss, m = fn(torch.zeros_like(lp), lp, torch.ones_like(lp), mask)
    naive = sum(-lp[i, t] for i in range(4) for t in range(6) if mask[i, t]) / mask.sum()
    assert torch.allclose(loss, naive)
    parts = sum(fn(torch.zeros(2, 6), lp[k:k + 2], torch.ones(2, 6), mask[k:k + 2], global_tokens=mask.sum())[0]
                for k in (0, 2))
    assert torch.allclose(parts, naive)
