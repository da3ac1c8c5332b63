"""Rules of indexing primitives: dynamic_slice, dynamic_update_slice, gather, scatter*.

Gather and scatter follow Shardy's construction (`addGatherScatterFactors`), adapted to jax's dimension
numbers (the index vector dim is always the last dim of the indices):

* batch dims — explicit (`operand_batching_dims` <-> `start_indices_batching_dims`) are one factor shared
  by operand, indices and result/updates; implicit ones (indices dims that are not batching dims) are
  shared by indices and result (gather) or indices and updates (scatter);
* offset / update-window dims — shared operand <-> result/updates when the slice is the whole dim;
* the index vector dim — its own need-replication factor;
* gather: collapsed dims and 1-wide offset dims are operand-only *reduction* factors: with the operand
  sharded along them each device gathers the rows it holds (zeros for the rest) and the partial results
  are summed — Megatron's vocab-parallel embedding, and what XLA's SPMD partitioner emits. Wider partial
  slices are need-replication (and blocked);
* scatter: inserted-window dims pass through operand <-> result (each device applies the updates that
  land in its rows); implicit batch dims appear only in operands (indices, updates), so for a combining
  scatter (add, mul, min, max) they are reduction factors — updates sharded over the batch give a partial
  result (data-parallel embedding gradients); for an overwriting `scatter` and for `scatter-sub` they
  are need-replication.
"""
from __future__ import annotations

from .builder import RuleBuilder
from .core import FactorKind, FactorRule, register_rule, rule_for

__all__ = ["SCATTER_REDUCE_OPS", "gather_rule", "scatter_rule"]

PT, RED, NR = FactorKind.PASS_THROUGH, FactorKind.REDUCTION, FactorKind.NEED_REPLICATION


def _all_scalars(shapes) -> bool:
    return all(len(s) == 0 for s in shapes)


@rule_for("dynamic_slice")
def dynamic_slice_rule(ins, outs, params) -> FactorRule | None:
    """(operand, *start indices) -> slice. A dim taken whole passes through; a sliced dim is
    need-replication and blocked on both sides (the slice position is only known at run time)."""
    if len(outs) != 1 or not ins:
        return None
    a, (r,) = ins[0], outs
    if len(ins) != 1 + len(a) or not _all_scalars(ins[1:]) or len(r) != len(a):
        return None
    b = RuleBuilder(ins, outs)
    for d, (n, m) in enumerate(zip(a, r)):
        if n == m:
            b.factor(n, operands={0: d}, results={0: d})
        else:
            b.factor(n, operands={0: d}, kind=NR, blocked=True)
            b.factor(m, results={0: d}, kind=NR, blocked=True)
    return b.build()


@rule_for("dynamic_update_slice")
def dynamic_update_slice_rule(ins, outs, params) -> FactorRule | None:
    """(operand, update, *start indices) -> result of operand's shape. The update shares the dims it covers
    whole with operand and result; its partial dims are need-replication (blocked): every device must see
    the whole update to write its part. Operand and result pass through on a dim the update covers one
    element wide (XLA's partitioner writes it with a select where it lands); a wider partial dim is
    need-replication on them too: XLA gathers the operand there (and slices the result again) unless the
    offset is a constant that puts the whole update in one shard, which a rule cannot see."""
    if len(outs) != 1 or len(ins) < 2:
        return None
    a, u, (r,) = ins[0], ins[1], outs
    if tuple(a) != tuple(r) or len(u) != len(a) or len(ins) != 2 + len(a) or not _all_scalars(ins[2:]):
        return None
    b = RuleBuilder(ins, outs)
    for d, (n, k) in enumerate(zip(a, u)):
        if n == k:
            b.factor(n, operands={0: d, 1: d}, results={0: d})
        else:
            if k == 1:
                b.factor(n, operands={0: d}, results={0: d})
            else:
                b.factor(n, operands={0: d}, results={0: d}, kind=NR, blocked=True)
            b.factor(k, operands={1: d}, kind=NR, blocked=True)
    return b.build()


@rule_for("gather")
def gather_rule(ins, outs, params) -> FactorRule | None:
    if len(ins) != 2 or len(outs) != 1:
        return None
    operand, indices = ins
    (res,) = outs
    if not indices:
        return None
    dn = params["dimension_numbers"]
    offset_dims = tuple(int(d) for d in dn.offset_dims)
    collapsed = tuple(int(d) for d in dn.collapsed_slice_dims)
    op_batch = tuple(int(d) for d in getattr(dn, "operand_batching_dims", ()) or ())
    idx_batch = tuple(int(d) for d in getattr(dn, "start_indices_batching_dims", ()) or ())
    slice_sizes = tuple(int(s) for s in params["slice_sizes"])
    ivd = len(indices) - 1
    if len(res) != ivd + len(offset_dims) or len(op_batch) != len(idx_batch) or len(slice_sizes) != len(operand):
        return None
    b = RuleBuilder(ins, outs)
    in_dim = 0
    batch_pos = 0
    for rd, rsize in enumerate(res):
        if rd in offset_dims:
            while in_dim in collapsed or in_dim in op_batch:
                in_dim += 1
            if in_dim >= len(operand) or slice_sizes[in_dim] != rsize:
                return None
            n = operand[in_dim]
            if n == rsize:
                b.factor(n, operands={0: in_dim}, results={0: rd})
            elif rsize == 1:
                b.factor(n, operands={0: in_dim}, kind=RED)
            else:
                b.factor(n, operands={0: in_dim}, kind=NR, blocked=True)
                b.factor(rsize, results={0: rd}, kind=NR, blocked=True)
            in_dim += 1
        else:
            idim = batch_pos
            batch_pos += 1
            if idim >= ivd or indices[idim] != rsize:
                return None
            if idim in idx_batch:
                od = op_batch[idx_batch.index(idim)]
                if operand[od] != rsize:
                    return None
                b.factor(rsize, operands={0: od, 1: idim}, results={0: rd})
            else:
                b.factor(rsize, operands={1: idim}, results={0: rd})
    for d in collapsed:
        b.factor(operand[d], operands={0: d}, kind=RED)
    b.factor(indices[ivd], operands={1: ivd}, kind=NR)
    return b.build(reduce_op="sum")


# scatter primitive -> combiner of partial results along implicit batch dims (None: cannot combine)
SCATTER_REDUCE_OPS = {
    "scatter": None,
    "scatter-add": "sum",
    "scatter-mul": "prod",
    "scatter-min": "min",
    "scatter-max": "max",
    "scatter-sub": None,
}


def scatter_rule(reduce_op: str | None):
    def rule(ins, outs, params) -> FactorRule | None:
        if len(ins) != 3 or len(outs) != 1:
            return None
        operand, indices, updates = ins
        (res,) = outs
        if tuple(res) != tuple(operand) or not indices:
            return None
        dn = params["dimension_numbers"]
        window = tuple(int(d) for d in dn.update_window_dims)
        inserted = tuple(int(d) for d in dn.inserted_window_dims)
        op_batch = tuple(int(d) for d in getattr(dn, "operand_batching_dims", ()) or ())
        idx_batch = tuple(int(d) for d in getattr(dn, "scatter_indices_batching_dims", ()) or ())
        ivd = len(indices) - 1
        if len(updates) != ivd + len(window) or len(op_batch) != len(idx_batch):
            return None
        b = RuleBuilder(ins, outs)
        in_dim = 0
        batch_pos = 0
        for ud, usize in enumerate(updates):
            if ud in window:
                while in_dim in inserted or in_dim in op_batch:
                    in_dim += 1
                if in_dim >= len(operand):
                    return None
                n = operand[in_dim]
                if n == usize:
                    b.factor(n, operands={0: in_dim, 2: ud}, results={0: in_dim})
                else:
                    b.factor(n, operands={0: in_dim}, results={0: in_dim}, kind=NR)
                    b.factor(usize, operands={2: ud}, kind=NR)
                in_dim += 1
            else:
                idim = batch_pos
                batch_pos += 1
                if idim >= ivd or indices[idim] != usize:
                    return None
                if idim in idx_batch:
                    od = op_batch[idx_batch.index(idim)]
                    if operand[od] != usize:
                        return None
                    b.factor(usize, operands={0: od, 1: idim, 2: ud}, results={0: od})
                else:
                    b.factor(usize, operands={1: idim, 2: ud}, kind=RED if reduce_op else NR)
        for d in inserted:
            b.factor(operand[d], operands={0: d}, results={0: d})
        b.factor(indices[ivd], operands={1: ivd}, kind=NR)
        return b.build(reduce_op=reduce_op or "sum")

    return rule


for _prim, _op in SCATTER_REDUCE_OPS.items():
    register_rule(_prim, scatter_rule(_op))
    if "-" in _prim:  # the spelling some jax versions / users use
        register_rule(_prim.replace("-", "_"), scatter_rule(_op))
