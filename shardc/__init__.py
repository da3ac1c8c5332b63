"""shardc: a GShard-style SPMD sharding compiler for JAX.

    mesh = shardc.make_mesh({"data": 2, "model": 4})

    @shardc.auto(mesh=mesh)
    def train_step(params, opt_state, batch): ...

    print(shardc.plan(train_step, params, opt_state, batch).explain())
"""
from annotations import UNCONSTRAINED, ShardingError, replicate, shard, split
from shardc.auto import AutoFunction, auto, plan, plan_for
from shardc.check import check
from shardc.cost.topology import Topology
from shardc.plan import Plan, Reshard
from shardc.rules.core import register_rule
from shardc.sharding import Sharding, make_mesh
from shardc.sim import simulate
from shardc.search import baselines
from shardc.search.budget import SearchTimeCapWarning
from shardc.search.integrate import AxisNameWarning
from shardc.carried import ReplanWarning
from shardc.waste import IdleDevicesWarning
from shardc.flax_rules import UnhintedParamsWarning
from shardc.placement import PlacementWarning

__all__ = [
    "auto", "plan", "plan_for", "make_mesh", "split", "replicate", "shard", "UNCONSTRAINED", "ShardingError",
    "Plan", "Reshard", "Sharding", "AutoFunction", "register_rule", "Topology", "simulate", "baselines",
    "SearchTimeCapWarning", "AxisNameWarning", "ReplanWarning", "IdleDevicesWarning", "PlacementWarning",
    "UnhintedParamsWarning",
]
__version__ = "0.1.0"
