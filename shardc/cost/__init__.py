"""The cost model: topologies, collective costs, which collectives a reshard makes, op costs, memory.

    topology.py     Topology, Device, Level, MeshMapping (mesh axes -> link levels)
    presets.py      h100-sxm-8[xN], a100-40g-8, tpu-v4-N, tpu-v5e-N, cpu-host (calibrate.py)
    collectives.py  alpha-beta ring / hierarchical formulas, per-level phases
    reshard.py      the collectives XLA's partitioner emits for a change of sharding
    flops.py        FLOPs per primitive at local shapes, as XLA's cost analysis counts them
    estimator.py    OpCostEstimator interface, roofline, fake; profile.py: measured, cached on disk
    program.py      what XLA keeps of a program (CSE, DCE, constant folding, fusion, loop trips)
    memory.py       per-device peak memory by liveness
    hlo.py          collectives of a compiled program, read from its HLO text
    op_collectives.py  collectives an op makes by itself (rule table); gather_groups.py: a gather's or
                    scatter's regrouping by its operand's device groups (XLA's collective-permutes)
"""
from shardc.cost import gather_groups as _gather_groups  # noqa: F401  (registers gather/scatter collectives)
from shardc.cost.collectives import Collective, Phase, collective_phases, collective_time
from shardc.cost.estimator import AnalyticalEstimator, FakeEstimator, OpCostEstimator, OpKey
from shardc.cost.reshard import reshard_collectives
from shardc.cost.topology import Device, Level, MeshMapping, Topology

__all__ = [
    "Topology", "Device", "Level", "MeshMapping", "Collective", "Phase", "collective_phases", "collective_time",
    "reshard_collectives", "OpKey", "OpCostEstimator", "AnalyticalEstimator", "FakeEstimator",
]
