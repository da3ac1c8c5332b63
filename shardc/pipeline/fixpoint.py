"""The pipeline loop linearized in one pass instead of two: the same program, traced faster.

JAX linearizes a `scan` (`jax._src.lax.control_flow.loops._scan_linearize`) by a fixpoint over which carried
values have nonzero tangents: it linearizes the body with the carries' tangents as they enter the loop, and
again with those its outputs add, until nothing changes. The pipeline loop (`shardc.pipeline.loop`) carries
(io buffers, stage-shift buffers); the shift buffers start as zeros (tangent zero) and leave as the stages'
outputs (tangent nonzero), so every pipelined trace linearized the whole loop body twice and kept only the
second: a fifth to a quarter of the trace of a candidate pipeline (`choose_pipeline` traces dozens).

`known_fixpoint(n)` (around the loop's `scan` call) starts that one linearization from where JAX's fixpoint
ends, exactly, when it can tell:

* the body reads each shift buffer only through `where(row 0, io column, shift)` (the stage input), so
  when every io buffer enters with a nonzero tangent, every stage input has one whatever the shift
  buffers' tangents are; the body's outputs' tangents then do not depend on the shift buffers' ones, and
  JAX's fixpoint ends at (io: all nonzero, shift: what the body's outputs give);
* so the body is linearized once with every carry nonzero, and when that pass gives every carry nonzero
  back, that *is* JAX's fixpoint: `_scan_linearize` is called with it (its first linearization is that
  pass, from JAX's cache) and returns what it returns when it starts from the entering tangents, since
  after the fixpoint it reads only the final nonzeros. Otherwise (an io buffer without a tangent, a shift
  buffer the body leaves zero) JAX's own fixpoint runs as before.

Only the first `scan` linearization in the block is this loop's (its body is traced before it is bound;
scans inside the body are linearized later, inside it), and only it is touched; outside JAX's direct
linearization (or when these JAX internals are not there) nothing changes. Tested: the traced pipelined
programs are equal with and without it (`tests/pipeline/test_pipeline_fixpoint.py`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["known_fixpoint"]

try:  # JAX internals (0.10): the scan primitive, its linearization rule and the linearization registry
    from jax._src.interpreters import ad as _ad
    from jax._src.lax.control_flow import loops as _loops

    _SCAN, _RULES, _LINEARIZE = _loops.scan_p, _ad.primitive_linearizations, _ad.linearize_jaxpr
except (ImportError, AttributeError):  # pragma: no cover - another JAX: the loop is linearized as JAX does
    _SCAN = _RULES = _LINEARIZE = None


@contextlib.contextmanager
def known_fixpoint(leaves: int) -> Iterator[None]:
    """Around the pipeline loop's `scan` (carry: `leaves` io buffers, then `leaves` shift buffers): its
    linearization starts from JAX's fixpoint when that is known (module docstring). Same program."""
    if _SCAN is None or _RULES.get(_SCAN) is None:
        yield
        return
    original = _RULES[_SCAN]
    _RULES[_SCAN] = _first_call(original, leaves)
    try:
        yield
    finally:
        _RULES[_SCAN] = original


def _first_call(original: Callable, leaves: int) -> Callable:
    """`original` (the scan linearization rule), started from the fixpoint on its first call only, in this
    thread (another thread's scans are linearized as JAX does)."""
    done, thread = [False], threading.get_ident()

    def rule(is_vjp: bool, nzs: list[bool], *primals: Any, **params: Any) -> Any:
        if done[0] or threading.get_ident() != thread:
            return original(is_vjp, nzs, *primals, **params)
        done[0] = True
        _RULES[_SCAN] = original  # (scans linearized inside this one are not the loop)
        try:
            start = _fixpoint(nzs, primals, params, leaves, is_vjp)
        except (TypeError, ValueError, AttributeError, IndexError):  # another JAX's internals: JAX's own fixpoint
            start = nzs
        return original(is_vjp, start, *primals, **params)

    return rule


def _fixpoint(nzs: list[bool], primals: tuple, params: dict, leaves: int, is_vjp: bool) -> list[bool]:
    """The carries' nonzero tangents JAX's fixpoint ends at, as the scan's `nzs`, when known (every io
    buffer entering nonzero, and a pass with every carry nonzero giving every carry nonzero back); else
    `nzs` as given (JAX's fixpoint runs)."""
    consts, carry = params.get("num_consts"), params.get("num_carry")
    jaxpr = params.get("jaxpr")
    if not isinstance(consts, int) or carry != 2 * leaves or jaxpr is None or not all(nzs[consts:consts + leaves]):
        return nzs
    guess = list(nzs[:consts]) + [True] * carry + list(nzs[consts + carry:])
    outs = len(jaxpr.out_avals) - carry
    # (the arguments _scan_linearize passes: its own first linearization is then this one, from JAX's cache)
    allow = [True] * len(jaxpr.consts) + [(i < consts or i >= consts + carry) and not isinstance(x, np.ndarray)
                                          for i, x in enumerate(primals)]
    _, _, nzs_out, _, _ = _LINEARIZE(jaxpr, guess, instantiate=[True] * carry + [False] * outs, allow_fwds=allow,
                                     is_vjp=is_vjp)
    return guess if all(nzs_out[:carry]) else nzs
