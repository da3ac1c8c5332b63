"""Parallel Computation Graph: explicit parallel ops, Z3-verified substitutions, rule generation.

    c = shardc.auto(step, mesh=mesh).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr)        # Partition/Combine/Reduce on every changing edge
    res = optimize(pcg)                             # proved rules, kept only when the simulator says they pay
    f = lower_pcg(res.pcg)                          # shard_map with one collective per parallel op
    f(*jax.tree.leaves(args))

See docs/pcg.md.
"""
from shardc.pcg.build import build_pcg, reshard_ops
from shardc.pcg.costs import CostFn, bytes_moved, compute_work
from shardc.pcg.generate import GenerationReport, generate_rules
from shardc.pcg.graph import PCG, CommTask, Compute, GraphBuilder, Node, Region, Tensor
from shardc.pcg.hlo import hlo_collectives
from shardc.pcg.lang import Rule, RuleSyntaxError, parse_rule, parse_rules
from shardc.pcg.library import all_rules, generated_rules, library_rules
from shardc.pcg.lower import lower_pcg
from shardc.pcg.match import Match, UnprovedRuleError, apply_match, find_matches, rewrites
from shardc.pcg.ops import (AllToAll, CollectivePermute, Combine, ParallelOp, Partition, Reduce, ReduceScatter,
                            Replicate)
from shardc.pcg.optimize import Lookahead, Optimized, Step, optimize
from shardc.pcg.simcost import PCGSimulation, SimCost, pcg_plan, simulate_pcg
from shardc.pcg.verify import Verdict, is_proved, verify_rule, verify_rules

__all__ = [
    "PCG", "Tensor", "Node", "Compute", "Region", "CommTask", "GraphBuilder", "build_pcg", "reshard_ops", "lower_pcg",
    "ParallelOp", "Partition", "Combine", "Replicate", "Reduce", "ReduceScatter", "AllToAll", "CollectivePermute",
    "Rule", "RuleSyntaxError", "parse_rule", "parse_rules", "library_rules", "generated_rules", "all_rules",
    "Verdict", "verify_rule", "verify_rules", "is_proved",
    "Match", "find_matches", "apply_match", "rewrites", "UnprovedRuleError",
    "CostFn", "bytes_moved", "compute_work", "optimize", "Optimized", "Step", "Lookahead",
    "SimCost", "simulate_pcg", "PCGSimulation", "pcg_plan",
    "generate_rules", "GenerationReport", "hlo_collectives",
]
