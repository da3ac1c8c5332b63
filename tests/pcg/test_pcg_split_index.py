"""An argmax / argmin over a dim split across devices runs by pieces in the PCG (`shardc.pcg.split_index`), as
the plan prices it and XLA runs it: the best of each piece gathered, not the operand."""
import collections

import jax
import jax.numpy as jnp
import numpy as np

import shardc
from shardc import split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg
from shardc.pcg.simcost import simulate_pcg
from shardc.sim import as_topology, simulate


def _scores() -> np.ndarray:
    """Rows whose best element is hard to find by pieces (pieces of 16 over `model` = 4): a tie everywhere, a tie
    across pieces, a tie inside one piece, a NaN in two pieces, a best in the last piece."""
    x = np.array(jax.random.normal(jax.random.key(7), (16, 64)))
    x[0] = 1.0
    x[1, [5, 40]] = 9.0
    x[2, [17, 18]] = -9.0
    x[3, [50, 20]] = np.nan
    x[4, 63] = 11.0
    return x


def test_an_argmax_over_a_split_dim_gathers_each_pieces_best_not_the_operand():
    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def f(x, w):
        scores = split(x, 1, "model") * w
        return jnp.argmax(scores, axis=1), jnp.argmin(scores, axis=-1)

    args = (jnp.asarray(_scores()), jnp.ones((64,)))
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    topo = as_topology("h100-sxm-8")
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True, reduce_scatter=topo.reduce_scatter)
    gathered = collections.Counter(pcg.tensors[n.inputs[0]].shape for n in pcg.parallel_nodes())
    assert (16, 64) not in gathered and gathered[(16, 4)] == 4  # (values and indices, per op)
    plan_sim, pcg_sim = simulate(c.plan, topo), simulate_pcg(pcg, topo).result
    assert pcg_sim.payload == plan_sim.payload  # (XLA's two all-gathers per op, as the plan's compiled program has)
    fn = lower_pcg(pcg)
    for got, want in zip(fn(*args), f(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [int(i) for i in f(*args)[0][:5]] == [0, 5, int(np.argmax(_scores()[2])), 20, 63]
    assert [int(i) for i in f(*args)[1][:4]] == [0, int(np.argmin(_scores()[1])), 17, 20]
    assert hlo_collectives(fn.lower(*args).compile().as_text()) == pcg.collectives()
