"""A rewrite spliced into its parent's node list (`shardc.pcg.splice`, the fast path of `apply_matches`) makes, node
for node, the PCG that `GraphBuilder.finish` (sort, topological order, dead-code removal) makes, with the readers and
producers maps a fresh PCG computes; where a rerouted reader would come too early it leaves the PCG to `finish`."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardc
import shardc.pcg.match as match_module
from shardc import split
from shardc.pcg import PCG
from shardc.pcg.library import all_rules
from shardc.pcg.match import RewriteError, apply_match, apply_matches, find_matches, independent
from shardc.pcg.verify import verify_rule
from tests.pcg.test_pcg_rewrite import pcg_of


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def proved():
    return [r for r in all_rules() if verify_rule(r).proved]


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        q, k, v = (split(nn.Dense(32)(h), 2, "model") for _ in range(3))
        a = jax.nn.softmax(jnp.einsum("bsd,btd->bst", q, k) / 4.0) @ v
        x = x + nn.Dense(32)(a)
        return x + nn.Dense(32)(jax.nn.gelu(split(nn.Dense(64)(nn.LayerNorm()(x)), 2, "model")))


@pytest.fixture(scope="module")
def block_pcg(mesh):
    model = _Block()
    x = jax.random.normal(jax.random.key(1), (4, 8, 32))
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.adam(1e-3)

    def step(params, opt, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, split(x, 0, "data")) ** 2))(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss

    return pcg_of(step, mesh, params, tx.init(params), x, fuse=True)


def _layout(pcg: PCG):
    return ([(n.id, repr(n.op), n.inputs, n.outputs) for n in pcg.nodes], pcg.outputs, sorted(pcg.consts),
            len(pcg.tensors), pcg.inputs)


def _maps(pcg: PCG):
    users = {t: [n.id for n in ns] for t, ns in pcg._users.items() if ns}
    producers = {t: (n.id, n.inputs, i) for t, (n, i) in pcg._producers.items()}
    return users, producers


def _both_ways(pcg: PCG, matches, monkeypatch):
    """`apply_matches` spliced (when it can) and through `finish`: (PCG or error text) each."""
    def attempt():
        try:
            return apply_matches(pcg, matches)
        except RewriteError as e:
            return str(e)

    fast = attempt()
    with monkeypatch.context() as m:
        m.setattr(match_module, "is_clean", lambda p: False)
        slow = attempt()
    return fast, slow


def _counting_splices(monkeypatch):
    made = {"spliced": 0, "declined": 0}
    real = match_module.splice

    def counted(*a, **k):
        out = real(*a, **k)
        made["declined" if out is None else "spliced"] += 1
        return out

    monkeypatch.setattr(match_module, "splice", counted)
    return made


def test_every_rewrite_spliced_is_the_pcg_finish_makes(block_pcg, proved, monkeypatch):
    """Every match of every proved rule on a transformer block's train step, and again on a rewritten PCG two
    rewrites on: the same nodes (ids, operators, operands, results) in the same order, the same outputs and
    constants, the same refusals, and readers/producers maps equal to those the spliced PCG computes afresh."""
    made = _counting_splices(monkeypatch)
    pcg, compared = block_pcg, 0
    for _ in range(3):
        matches = [m for r in proved for m in find_matches(pcg, r)]
        follow = None
        for m in matches:
            fast, slow = _both_ways(pcg, [m], monkeypatch)
            assert type(fast) is type(slow)
            if isinstance(fast, str):
                assert fast == slow
                continue
            assert _layout(fast) == _layout(slow), str(m)
            seeded = _maps(fast)  # (given by the splice where the parent had its maps)
            fresh = PCG(fast.mesh, fast.tensors, fast.nodes, fast.inputs, fast.outputs, fast.consts)
            assert seeded == _maps(fresh), str(m)
            compared += 1
            follow = follow or fast
        pcg = follow
    assert compared > 50 and made["spliced"] > compared // 2  # (most: a fused pair of dots may need `finish`)


def test_a_repeated_rewrite_applied_together_is_spliced_too(block_pcg, proved, monkeypatch):
    made = _counting_splices(monkeypatch)
    groups = [ms for r in proved if len(ms := list(find_matches(block_pcg, r))) > 1 and independent(ms)]
    assert groups
    for ms in groups:
        fast, slow = _both_ways(block_pcg, ms, monkeypatch)
        assert (fast == slow) if isinstance(fast, str) else _layout(fast) == _layout(slow)
    assert made["spliced"] > 0


def test_a_reader_between_the_matched_nodes_leaves_the_pcg_to_finish(mesh, monkeypatch):
    """Two dots sharing an operand fused into one (`fuse_dots`): the first one's reader runs before the second dot,
    where the fused dot is placed, so the splice declines and `finish` moves the reader after it."""
    def f(x, w1, w2):
        c = jnp.tanh(split(x, 0, "data") @ w1)
        return c * 2.0, x @ w2

    k = jax.random.split(jax.random.key(2), 3)
    pcg = pcg_of(f, mesh, jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 8)),
                 jax.random.normal(k[2], (32, 8)))
    fuse = next(r for r in all_rules() if r.name == "fuse_dots")
    assert verify_rule(fuse).proved
    m = next(find_matches(pcg, fuse))
    made = _counting_splices(monkeypatch)
    new = apply_match(pcg, m)
    assert made == {"spliced": 0, "declined": 1}
    fast, slow = _both_ways(pcg, [m], monkeypatch)
    assert _layout(fast) == _layout(slow) == _layout(new)
    tanh = next(i for i, n in enumerate(new.nodes) if getattr(n.op, "primitive", "") == "tanh")
    fused = next(i for i, n in enumerate(new.nodes) if n.id not in {x.id for x in pcg.nodes}
                 and getattr(n.op, "primitive", "") == "dot_general")
    assert fused < tanh  # (the reader moved after the fused dot)
