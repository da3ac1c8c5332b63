"""Property tests of GShard top-2 gating (and the top-1 Switch router)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe
from moe.gating import compute_capacity


def _rand_logits(seed, g=4, s=64, e=8, scale=3.0):
    return jax.random.normal(jax.random.key(seed), (g, s, e)) * scale


def test_public_api_and_shapes():
    logits = _rand_logits(0, 2, 16, 4)
    out = moe.top2_gating(logits, expert_capacity=5)
    combine, dispatch, aux = out  # unpacks as a 3-tuple
    assert combine.shape == (2, 16, 4, 5) and combine.dtype == jnp.float32
    assert dispatch.shape == (2, 16, 4, 5) and dispatch.dtype == jnp.bool_
    assert aux.shape == () and aux.dtype == jnp.float32
    # Default capacity is the paper's 2S/E.
    assert moe.top2_gating(logits).combine_weights.shape[-1] == 2 * 16 // 4


def test_capacity_formula():
    assert compute_capacity(64, 8, 2.0) == 16
    assert compute_capacity(64, 8, 1.0) == 8
    assert compute_capacity(10, 4, 2.0) == 5
    assert compute_capacity(6, 4, 2.0) == 3  # ceil(3.0)
    assert compute_capacity(5, 4, 1.0) == 2  # ceil(1.25)
    assert compute_capacity(2, 64, 1.0, min_capacity=4) == 4
    with pytest.raises(ValueError):
        compute_capacity(8, 4, 0.0)


@pytest.mark.parametrize("shape", [(1, 8, 4), (3, 16, 8), (2, 12, 2)])
def test_aux_loss_uniform_is_exactly_one(shape):
    aux = moe.top2_gating(jnp.zeros(shape)).aux_loss
    assert float(aux) == 1.0


def test_aux_loss_balanced_peaked_is_one():
    # Token s strongly prefers expert s % E: perfectly balanced hard routing -> 1.0.
    g, s, e = 2, 16, 4
    logits = 50.0 * jax.nn.one_hot(jnp.arange(s) % e, e)[None].repeat(g, 0)
    np.testing.assert_allclose(float(moe.top2_gating(logits).aux_loss), 1.0, rtol=1e-6)


@pytest.mark.parametrize("e", [2, 4, 8])
def test_aux_loss_total_collapse_is_E(e):
    logits = jnp.zeros((2, 16, e)).at[..., 1].set(100.0)
    np.testing.assert_allclose(float(moe.top2_gating(logits).aux_loss), float(e), rtol=1e-6)


def test_aux_loss_random_is_at_least_one_ish():
    for seed in range(5):
        aux = float(moe.top2_gating(_rand_logits(seed)).aux_loss)
        assert 0.9 < aux < 1.6


@pytest.mark.parametrize("policy", ["all", "random"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 2.0, 4.0])
def test_dispatch_invariants(policy, cf):
    logits = _rand_logits(1, 4, 64, 8)
    out = moe.top2_gating(logits, jax.random.key(3), capacity_factor=cf, second_expert_policy=policy)
    combine = np.asarray(out.combine_weights)
    dispatch = np.asarray(out.dispatch_mask)
    # Every (g, e, c) slot holds at most one token.
    assert dispatch.sum(axis=1).max() <= 1
    # Every token is in at most two slots, at most one per expert.
    assert dispatch.sum(axis=(2, 3)).max() <= 2
    assert dispatch.sum(axis=3).max() <= 1
    # dispatch == (combine > 0)
    np.testing.assert_array_equal(dispatch, combine > 0)
    # Per-token combine weights sum to at most 1.
    assert combine.sum(axis=(2, 3)).max() <= 1.0 + 1e-6
    assert combine.min() >= 0.0
    # Slots are filled from position 0 without holes.
    filled = dispatch.sum(axis=1)  # [G, E, C]
    assert (np.diff(filled, axis=-1) <= 0).all()


def test_no_drops_all_policy_weights_sum_to_one_and_pick_top2():
    logits = _rand_logits(2, 2, 32, 4)
    out = moe.top2_gating(logits, expert_capacity=32, second_expert_policy="all")
    combine = np.asarray(out.combine_weights)
    np.testing.assert_allclose(combine.sum(axis=(2, 3)), 1.0, rtol=1e-5)
    per_expert = combine.sum(axis=3)  # [G, S, E]
    probs = np.asarray(jax.nn.softmax(logits, -1))
    top2 = np.argsort(-probs, axis=-1)[..., :2]
    for g in range(2):
        for s in range(32):
            e1, e2 = top2[g, s]
            p1, p2 = probs[g, s, e1], probs[g, s, e2]
            np.testing.assert_allclose(per_expert[g, s, e1], p1 / (p1 + p2), rtol=1e-5)
            np.testing.assert_allclose(per_expert[g, s, e2], p2 / (p1 + p2), rtol=1e-5)
            assert (per_expert[g, s] > 0).sum() == 2


def test_capacity_overflow_drops_later_tokens():
    # All 32 tokens prefer expert 0, then expert 1. C = 4.
    logits = jnp.tile(jnp.array([10.0, 5.0, 0.0, 0.0]), (1, 32, 1))
    out = moe.top2_gating(logits, expert_capacity=4, second_expert_policy="all")
    d = np.asarray(out.dispatch_mask)[0]  # [S, E, C]
    # Expert 0 holds tokens 0..3 (first choices) in slots 0..3.
    for c in range(4):
        assert d[c, 0, c]
    assert d[:, 0].sum() == 4
    # Expert 1 holds tokens 0..3 too: their second choice, capacity is per expert.
    assert [int(np.nonzero(d[:, 1, c])[0][0]) for c in range(4)] == [0, 1, 2, 3]
    # The other 28 tokens get no expert.
    assert d[4:].sum() == 0
    # A token that keeps only its first expert keeps the weight g1 / (g1 + g2) < 1, no renormalisation.
    out2 = moe.top2_gating(logits, expert_capacity=4, second_expert_policy="all")
    w = np.asarray(out2.combine_weights)[0]
    p = np.asarray(jax.nn.softmax(jnp.array([10.0, 5.0, 0.0, 0.0])))
    np.testing.assert_allclose(w[0, 0, 0], p[0] / (p[0] + p[1]), rtol=1e-6)


def test_first_choices_take_slots_before_second_choices():
    # Token 0: first expert 0, second expert 1. Tokens 1, 2: first expert 1.
    # Expert 1 has C = 2 slots: both go to the *later* tokens' first choices, token 0's second choice is dropped.
    e = 3
    logits = jnp.array([[[5.0, 4.0, 0.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [5.0, 0.0, 1.0]]])
    out = moe.top2_gating(logits, expert_capacity=2, second_expert_policy="all")
    d = np.asarray(out.dispatch_mask)[0]
    assert d[1, 1, 0] and d[2, 1, 1]
    assert not d[0, 1].any()
    assert d[0, 0, 0]
    assert d.shape == (4, e, 2)
    # Token 3's first choice (expert 0) is in slot 1, after token 0.
    assert d[3, 0, 1]
    # With one more slot, token 0's second choice comes after all first choices.
    d3 = np.asarray(moe.top2_gating(logits, expert_capacity=3, second_expert_policy="all").dispatch_mask)[0]
    assert d3[0, 1, 2]


def test_random_policy_keep_rate():
    g, s, e = 8, 512, 4
    logits = jax.random.normal(jax.random.key(7), (g, s, e)) * 1.5
    big_c = s  # no capacity drops
    out_all = moe.top2_gating(logits, expert_capacity=big_c, second_expert_policy="all")
    probs = jax.nn.softmax(logits, -1)
    top2 = jax.lax.top_k(probs, 2)[0]
    g2 = top2[..., 1] / (top2[..., 0] + top2[..., 1])
    expected = float(jnp.mean(jnp.minimum(1.0, 2.0 * g2)))
    rates = []
    for seed in range(4):
        out = moe.top2_gating(logits, jax.random.key(seed), expert_capacity=big_c, second_expert_policy="random")
        n = np.asarray(out.dispatch_mask).sum(axis=(2, 3))
        assert n.min() >= 1
        rates.append(float((n == 2).mean()))
    assert abs(np.mean(rates) - expected) < 0.02, (rates, expected)
    assert np.asarray(out_all.dispatch_mask).sum(axis=(2, 3)).min() == 2
    # Threshold 0.25 keeps the second expert w.p. min(1, 4 g2).
    out = moe.top2_gating(logits, jax.random.key(9), expert_capacity=big_c, second_expert_threshold=0.25)
    rate = float((np.asarray(out.dispatch_mask).sum(axis=(2, 3)) == 2).mean())
    assert abs(rate - float(jnp.mean(jnp.minimum(1.0, 4.0 * g2)))) < 0.03


def test_random_policy_extremes_and_determinism():
    # Uniform gates: g2 = 0.5 -> 2 g2 = 1 -> always kept.
    out = moe.top2_gating(jnp.zeros((2, 16, 4)), jax.random.key(0), expert_capacity=16)
    assert np.asarray(out.dispatch_mask).sum(axis=(2, 3)).min() == 2
    # Very peaked gates: g2 ~ 0 -> (almost) never kept.
    logits = jnp.zeros((2, 64, 4)).at[..., 0].set(30.0)
    out = moe.top2_gating(logits, jax.random.key(0), expert_capacity=64)
    assert np.asarray(out.dispatch_mask).sum(axis=(2, 3)).max() == 1
    # No rng: deterministic, keeps every second choice (eval).
    logits = _rand_logits(4)
    a = moe.top2_gating(logits)
    b = moe.top2_gating(logits)
    c = moe.top2_gating(logits, second_expert_policy="all")
    np.testing.assert_array_equal(np.asarray(a.combine_weights), np.asarray(b.combine_weights))
    np.testing.assert_array_equal(np.asarray(a.combine_weights), np.asarray(c.combine_weights))
    # Same rng -> same routing.
    r1 = moe.top2_gating(logits, jax.random.key(5))
    r2 = moe.top2_gating(logits, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(r1.dispatch_mask), np.asarray(r2.dispatch_mask))


def test_padding_never_dispatched_and_excluded_from_loss():
    g, s, e = 2, 16, 4
    logits = _rand_logits(5, g, s, e)
    paddings = jnp.zeros((g, s), jnp.int32).at[:, 10:].set(1)
    out = moe.top2_gating(logits, paddings, jax.random.key(0), expert_capacity=3)
    d = np.asarray(out.dispatch_mask)
    assert d[:, 10:].sum() == 0
    assert np.asarray(out.combine_weights)[:, 10:].sum() == 0
    # Padding takes no slot: same routing as the real tokens alone.
    ref = moe.top2_gating(logits[:, :10], None, jax.random.key(0), expert_capacity=3)
    # (random draws are per position, so compare with the deterministic policy)
    a = moe.top2_gating(logits, paddings, expert_capacity=3)
    b = moe.top2_gating(logits[:, :10], expert_capacity=3)
    np.testing.assert_array_equal(np.asarray(a.dispatch_mask)[:, :10], np.asarray(b.dispatch_mask))
    np.testing.assert_allclose(float(a.aux_loss), float(b.aux_loss), rtol=1e-6)
    del ref
    # Uniform logits with padding still give aux loss 1.0; bool paddings work too.
    pb = paddings.astype(bool)
    assert float(moe.top2_gating(jnp.zeros((g, s, e)), pb).aux_loss) == 1.0
    # A fully padded group is ignored by the loss.
    pfull = jnp.zeros((g, s), bool).at[1].set(True)
    np.testing.assert_allclose(
        float(moe.top2_gating(logits, pfull).aux_loss), float(moe.top2_gating(logits[:1]).aux_loss), rtol=1e-6
    )


def test_dtypes_bf16_logits_and_long_groups():
    # Logits are upcast to f32; positions stay exact beyond 256 tokens (int32 cumsum).
    s, e = 1024, 2
    logits = jnp.zeros((1, s, e), jnp.bfloat16).at[..., 0].set(1.0)
    out = moe.top2_gating(logits, expert_capacity=s, second_expert_policy="all")
    assert out.combine_weights.dtype == jnp.float32
    d = np.asarray(out.dispatch_mask)[0]
    assert d.sum(axis=0).max() == 1  # no slot collisions
    assert d[:, 0].sum() == s


def test_jit_and_grad_through_combine():
    logits = _rand_logits(6, 2, 16, 4)

    @jax.jit
    def f(l):
        out = moe.top2_gating(l, expert_capacity=8)
        return jnp.sum(out.combine_weights ** 2) + out.aux_loss

    g = jax.grad(f)(logits)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def test_errors():
    with pytest.raises(ValueError):
        moe.top2_gating(jnp.zeros((4,)))
    with pytest.raises(ValueError):
        moe.top2_gating(jnp.zeros((1, 4, 1)))
    with pytest.raises(ValueError):
        moe.top2_gating(jnp.zeros((1, 4, 4)), second_expert_policy="sampling")


# ----------------------------------------------------------------------------- top-1


def test_top1_gating():
    logits = _rand_logits(8, 2, 32, 4)
    out = moe.top1_gating(logits)
    d = np.asarray(out.dispatch_mask)
    assert d.shape == (2, 32, 4, 8)  # C = S/E
    assert d.sum(axis=(2, 3)).max() <= 1
    assert d.sum(axis=1).max() <= 1
    np.testing.assert_array_equal(d, np.asarray(out.combine_weights) > 0)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    w = np.asarray(out.combine_weights).sum(axis=(2, 3))
    kept = d.sum(axis=(2, 3)) == 1
    np.testing.assert_allclose(w[kept], probs.max(-1)[kept], rtol=1e-6)
    assert float(moe.top1_gating(jnp.zeros((2, 8, 4))).aux_loss) == 1.0
    np.testing.assert_allclose(
        float(moe.top1_gating(jnp.zeros((2, 8, 4)).at[..., 2].set(100.0)).aux_loss), 4.0, rtol=1e-6
    )
    # Overflow: all tokens to expert 0, C=3 -> tokens 0..2 kept.
    out = moe.top1_gating(jnp.zeros((1, 8, 4)).at[..., 0].set(5.0), expert_capacity=3)
    assert np.asarray(out.dispatch_mask)[0, :, 0].sum(axis=-1).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def test_routing_stats():
    logits = jnp.tile(jnp.array([10.0, 5.0, 0.0, 0.0]), (1, 8, 1))
    out = moe.top2_gating(logits, expert_capacity=2, second_expert_policy="all")
    st = moe.routing_stats(out.dispatch_mask)
    np.testing.assert_allclose(float(st.two_experts), 2 / 8)
    np.testing.assert_allclose(float(st.dropped), 6 / 8)
    np.testing.assert_allclose(np.asarray(st.expert_load), [1.0, 1.0, 0.0, 0.0])


def test_single_group_2d_logits():
    logits = _rand_logits(11, 1, 16, 4)
    a = moe.top2_gating(logits[0], expert_capacity=6)
    b = moe.top2_gating(logits, expert_capacity=6)
    assert a.combine_weights.shape == (16, 4, 6)
    np.testing.assert_array_equal(np.asarray(a.dispatch_mask), np.asarray(b.dispatch_mask)[0])
    assert float(a.aux_loss) == float(b.aux_loss)
