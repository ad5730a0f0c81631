"""Action tokenization (rlhf_mcore/vla/actions.py): round trips, the vocabulary range, statistics, the logits mask.

numpy only, except the mask's torch half; well under a second."""
import numpy as np
import pytest
import torch

from rlhf_mcore.vla.actions import ActionStats, ActionTokenizer

V, K, C, A = 1000, 64, 4, 3


def _tokenizer(stats=None, **kw):
    rng = np.random.default_rng(0)
    if stats is None:
        stats = ActionStats.from_actions(rng.normal(size=(5000, A)) * [1.0, 0.1, 3.0] + [0.0, 2.0, -1.0])
    return ActionTokenizer(vocab_size=kw.get("vocab_size", V), num_bins=kw.get("num_bins", K),
                           chunk=kw.get("chunk", C), action_dim=A, stats=stats)


def test_round_trip_within_half_a_bin_and_ids_in_range():
    """In [q01, q99] a round trip moves an action by at most half a bin width; outside it, the action is clipped
    first; ids are the last K of the vocabulary, step-major.
    Mutation: de-tokenize to the bin's lower edge instead of its centre -> the half-width bound fails."""
    tok = _tokenizer()
    rng = np.random.default_rng(1)
    lo, hi = tok.stats.q01, tok.stats.q99
    inside = rng.uniform(lo, hi, size=(50, C, A))
    ids = tok.tokenize(inside)
    assert ids.shape == (50, C * A) and ids.dtype == np.int64
    assert ids.min() >= V - K and ids.max() < V
    back = tok.detokenize(ids)
    assert back.shape == (50, C, A) and back.dtype == np.float32
    err = np.abs(back - inside)
    assert (err <= tok.bin_width / 2 + 1e-5).all()
    assert err.max() > tok.bin_width.min() / 4  # the bound is not met by accident (e.g. by a vanishing width)
    outside = inside + np.where(rng.random(inside.shape) < 0.5, -1, 1) * (hi - lo) * 2
    back = tok.detokenize(tok.tokenize(outside))
    assert (np.abs(back - np.clip(outside, lo, hi)) <= tok.bin_width / 2 + 1e-5).all()
    # step-major: changing step 1, dimension 2 changes token 1*A + 2 only
    one = inside[:1].copy()
    base = tok.tokenize(one)
    one[0, 1, 2] = hi[2]
    changed = np.flatnonzero(tok.tokenize(one) != base)
    assert set(changed) <= {1 * A + 2}


def test_every_bin_round_trips_exactly_and_in_order():
    """tokenize(detokenize(ids)) == ids for every bin of every dimension, and larger actions get larger ids.
    Mutation: round() instead of floor() in tokenize -> bins move by one."""
    tok = _tokenizer(chunk=1)
    bins = np.arange(K)
    ids = np.stack([V - K + bins] * A, axis=-1).reshape(K, A)  # (K, C*A) with C = 1
    assert (tok.tokenize(tok.detokenize(ids)) == ids).all()
    centres = tok.detokenize(ids)[:, 0]  # (K, A)
    assert (np.diff(centres, axis=0) > 0).all()


def test_statistics_from_demonstrations():
    """q01/q99 are the demonstrations' percentiles over every step (chunked or not), robust to an outlier; a
    constant dimension decodes to its value; JSON round trip."""
    rng = np.random.default_rng(2)
    demos = rng.uniform(-1, 1, size=(400, C, A))
    demos[..., 2] = 0.25  # constant (an unused gripper)
    demos[0, 0, 0] = 1e6  # one broken demonstration step
    stats = ActionStats.from_actions(demos)
    flat = demos.reshape(-1, A)
    assert np.allclose(stats.q01, np.quantile(flat, 0.01, axis=0))
    assert np.allclose(stats.q99, np.quantile(flat, 0.99, axis=0))
    assert stats.q99[0] < 1.0 and stats.max[0] == 1e6 and stats.count == 400 * C
    tok = _tokenizer(stats)
    assert np.all(tok.detokenize(tok.tokenize(demos[:3]))[..., 2] == np.float32(0.25))
    again = ActionStats.from_dict(stats.to_dict())
    assert all(np.array_equal(getattr(again, k), getattr(stats, k)) for k in ("q01", "q99", "mean", "std"))
    with pytest.raises(ValueError, match="NaN"):
        ActionStats.from_actions(np.array([[np.nan, 0, 0]]))


def test_logits_mask_restricts_decoding_to_action_tokens():
    """The mask is True on [V-K, V) only, padded rows included in the logits' width; greedy and sampled ids after
    restrict_logits are always action tokens and de-tokenize; the log-softmax mass is all on them.
    Mutation: mask from first_id + 1 -> the count and the greedy check fail."""
    tok = _tokenizer()
    padded = V + 24  # Megatron pads the vocabulary
    mask = tok.action_mask(padded)
    assert mask.shape == (padded,) and mask.sum() == K and mask[V - K:V].all() and not mask[V:].any()
    logits = torch.randn(8, C * A, padded)
    logits[..., 5] = 50.0  # a text token would win unrestricted
    logits[..., V + 3] = 60.0  # and so would a padding row
    restricted = tok.restrict_logits(logits)
    greedy = restricted.argmax(-1)
    assert ((greedy >= V - K) & (greedy < V)).all()
    assert torch.equal(restricted[..., V - K:V], logits[..., V - K:V])
    probs = torch.softmax(restricted, -1)
    assert torch.allclose(probs[..., V - K:V].sum(-1), torch.ones(8, C * A))
    sampled = torch.multinomial(probs.reshape(-1, padded), 1).reshape(8, C * A).numpy()
    assert tok.detokenize(sampled).shape == (8, C, A)
    with pytest.raises(ValueError, match="not an action token"):
        tok.detokenize(np.full((1, C * A), 5))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        _tokenizer(vocab_size=K)
    with pytest.raises(ValueError, match="num_bins"):
        _tokenizer(num_bins=1)
    with pytest.raises(ValueError, match="action_dim"):
        ActionTokenizer(vocab_size=V, num_bins=K, chunk=C, action_dim=A + 1, stats=_tokenizer().stats)
    with pytest.raises(ValueError, match="expected"):
        _tokenizer().tokenize(np.zeros((2, C + 1, A)))
