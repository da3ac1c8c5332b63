"""plan.explain() answers the first question first (mesh, topology, step time, memory, how each input group
is laid out, what each decision group chose and beat), names arguments as the step does, keeps lines
readable, never cuts the batch rows; devices that repeat work are never silent."""
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardc
from shardc.waste import IdleDevicesWarning, duplicated_flops

TX = optax.adam(1e-3)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(64)(nn.relu(nn.Dense(256)(x)))


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = Block()(x)
        return nn.Dense(8)(x)


MODEL = Stack()


def train_step(params, opt_state, batch):
    def loss_fn(p):
        return jnp.mean((MODEL.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _args(batch=64):
    x = jnp.ones((batch, 64))
    params = MODEL.init(jax.random.key(0), x)["params"]
    return params, TX.init(params), {"x": x, "y": jnp.zeros((batch, 8))}


@pytest.fixture(scope="module")
def searched():
    return shardc.auto(train_step, budget_s=1.0, seed=0).plan(*_args())


def test_the_overview_comes_before_the_details(searched):
    text = searched.explain()
    lines = text.splitlines()
    flat = " ".join(text.split())
    assert lines[0].startswith(f"shardc plan: mesh ({', '.join(f'{a}={n}' for a, n in searched.mesh_sizes.items())})")
    assert "priced on cpu-host (the devices this step runs on" in flat
    assert re.search(r"^step [\d.]+ (ms|us) simulated .* memory [\d.]+ \w+ per device at the peak", text, re.M)
    first_table = text.index("inputs (data first):")
    for group in ("params", "opt_state", "batch"):  # one line per input group, before any table
        assert re.search(rf"^  {group} +(state|data), \d+ tensors?, ", text, re.M), group
        assert text.index(f"  {group} ") < first_table
    assert text.index("decisions (") < text.index("strategy search") < text.index("simulated cost:") < first_table


def test_decision_groups_name_repeated_layers_and_what_they_beat(searched):
    text = searched.explain()
    decisions = text[text.index("decisions ("):text.index("strategy search")]
    assert re.search(r"Block_0-2/Dense_[01] \(3 dot_general of \[[\d,]+\] x \[[\d,]+\], \d+% of the step's "
                     r"FLOPs\): \[", " ".join(decisions.split()))
    notes = searched.search.groups
    assert notes, "the search compares the heaviest groups with the baselines' choices"
    baselines = {c.name for c in searched.search.baselines}
    for note in notes:
        assert set(note.same_as) <= baselines
        for who, dt in note.beats:
            assert set(who.split("/")) <= baselines and abs(dt) < 1.0
    said = [n for n in notes if n.beats]
    assert said and all(re.search(r"(faster|slower) than [\w/-]+'s choice", " ".join(decisions.split())) for _ in said)


def test_arguments_are_named_by_the_step_parameters(searched):
    names = searched.input_names
    assert "params['Block_0']['Dense_0']['kernel']" in names
    assert "opt_state[0].mu['Block_0']['Dense_0']['kernel']" in names and "batch['x']" in names
    text = searched.explain()  # (outputs keep the paths of what the step returns: out[0][...])
    assert not re.search(r"(?<!out)\[0\]\['Block_0'\]", text) and not re.search(r"(?<!out)\[1\]\[0\]\.mu", text)


def test_lines_fit_the_width_and_batch_rows_are_never_cut(searched):
    for width in (120, 90):
        text = searched.explain(max_rows=2, width=width)
        assert max(len(line) for line in text.splitlines()) <= width
        table = text[text.index("inputs (data first):"):text.index("outputs:")]
        assert "batch['x']" in table and "batch['y']" in table  # both batch rows, whatever max_rows
        assert re.search(r"\.\.\. \d+ more state inputs \(max_rows=2\)", table)


def test_search_false_on_an_unsplit_mesh_warns_once_and_says_compute_is_duplicated():
    f = shardc.auto(train_step, mesh=shardc.make_mesh({"data": 8}), search=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = f.plan(*_args())
        f.plan(*_args(32))  # another signature: planned again, not warned again
    ours = [w for w in caught if issubclass(w.category, IdleDevicesWarning)]
    assert len(ours) == 1 and "nothing is split on mesh (data=8)" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the user's call
    assert "compute duplicated 8 times: every device repeats the whole step" in plan.explain()
    assert set(duplicated_flops(plan)) == {8}


def test_an_axis_no_tensor_uses_warns_and_a_full_plan_does_not():
    from shardc import split

    def hinted(params, opt_state, batch):
        return train_step(params, opt_state, {"x": split(batch["x"], 0, "data"), "y": batch["y"]})

    mesh = shardc.make_mesh({"data": 4, "model": 2})
    with pytest.warns(IdleDevicesWarning, match=r"splits no tensor over mesh axis 'model'.*duplicated 2 times"):
        plan = shardc.auto(hinted, mesh=mesh, search=False).plan(*_args())
    assert re.search(r"^compute duplicated .*\b2 times on \d+%", plan.explain(), re.M)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdleDevicesWarning)
        shardc.auto(hinted, mesh=shardc.make_mesh({"data": 8}), search=False).plan(*_args())


def test_op_costs_follow_their_work_on_the_default_topology():
    """The most expensive ops of a small MLP differ in compute: a matmul with 16x the FLOPs costs more (on
    the H100 preset every kernel of this model is launch-bound, ~4 us each: priced on the CPU host, which
    runs it, they are not)."""
    def step(x, w1, w2):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum()

    x, w1, w2 = jnp.ones((256, 256)), jnp.ones((256, 1024)), jnp.ones((1024, 16))
    plan = shardc.auto(step, budget_s=0.3).plan(x, w1, w2)
    ops = {plan.graph.ops[o.op].outputs[0]: o for o in plan.cost.per_op() if o.primitive == "dot_general"}
    big, small = (ops[v] for v in sorted(ops, key=lambda v: -plan.graph.values[v].nbytes))
    assert big.flops >= 15 * small.flops and big.compute > 4 * small.compute
    top = plan.cost.summary().split("most expensive ops:")[1].splitlines()[1:]
    assert len({line.split("compute")[1].split("comm")[0].strip() for line in top}) > 1


def test_source_lines_of_code_without_a_file_are_the_users():
    """A step run from standard input, `python -c` or a notebook cell: its lines, not Flax's or optax's."""
    source = '''
from flax import nnx
import jax.numpy as jnp, optax

def make():
    net = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    return net, nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param)

def nnx_step(net, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(net)
    optimizer.update(net, grads)
    return loss
'''
    scope: dict = {}
    exec(compile(source, "<stdin>", "exec"), scope)
    net, opt = scope["make"]()
    plan = shardc.auto(scope["nnx_step"], mesh=shardc.make_mesh({"data": 8}), search=False).plan(
        net, opt, jnp.ones((8, 16)))
    lines = {str(op.source) for op in plan.graph.ops if op.source is not None}
    assert lines and all(line.startswith("<stdin>:") for line in lines), lines


def test_gradients_computed_in_a_loop_body_are_labelled_backward():
    """A scan's body ops carry only the body's name stack; the backward scan's are gradients all the same."""
    import jax
    import jax.numpy as jnp

    def loss(ws, h):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)
        return jnp.sum(h)

    step = jax.grad(loss)
    ws, h = jnp.ones((3, 16, 16)), jnp.ones((8, 16))
    plan = shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), search=False).plan(ws, h)
    text = plan.explain()
    decisions = " ".join(text[text.index("decisions ("):].split())
    forward = re.findall(r"test_explain\.py:\d+ \(\S+\) \(1 dot_general", decisions)
    backward = re.findall(r"test_explain\.py:\d+ \(\S+\) \(backward\) \(1 dot_general", decisions)
    assert len(forward) == 1 and len(backward) == 2  # h @ w; its gradients for h and for w
