"""Factor rules per primitive: one registry consulted by every pass (propagation, search, cost, lowering).

Importing this package registers the rules of every covered jax primitive. Public API:

* `FactorKind`, `FactorRule`, `einsum_rule`, `RuleBuilder` — build rules;
* `register_rule(prim, "ij,jk->ik")` / `@rule_for(prim)` — register one (a custom primitive, or an override);
* `get_rule`, `has_rule`, `registered_primitives` — look up;
* `rule_or_conservative(prim, ins, outs, params)` — the rule of one op instance, falling back (with one
  `NoShardingRuleWarning` per primitive) to `conservative_rule`, which replicates everything;
* `HIGHER_ORDER_PRIMITIVES` — primitives with sub-jaxprs that the graph builder handles, not rules.

See docs/rules.md.
"""
from .core import (
    HIGHER_ORDER_PRIMITIVES,
    FactorKind,
    FactorRule,
    NoShardingRuleWarning,
    RuleFn,
    conservative_rule,
    einsum_rule,
    get_rule,
    has_rule,
    register_rule,
    registered_primitives,
    rule_for,
    rule_or_conservative,
)
from .builder import RuleBuilder, pairwise_identity_rule, pointwise_rule

# Importing the rule modules registers their rules.
from . import contractions, elementwise, indexing, linalg, prng, reductions, shapes  # noqa: F401,E402
from .shapes import reshape_factors  # noqa: E402

__all__ = [
    "FactorKind",
    "FactorRule",
    "HIGHER_ORDER_PRIMITIVES",
    "NoShardingRuleWarning",
    "RuleBuilder",
    "RuleFn",
    "conservative_rule",
    "einsum_rule",
    "get_rule",
    "has_rule",
    "pairwise_identity_rule",
    "pointwise_rule",
    "register_rule",
    "registered_primitives",
    "reshape_factors",
    "rule_for",
    "rule_or_conservative",
]
