"""A PagedCache's step on a CUDA pool: one copy up per step, launches per layer.

``DeviceLane`` holds the pool's step lane (``kvcore/backends/cuda/lane.py``)
for one cache and speaks torch to it: a step's slots (and, for a short
step, its lengths and block tables) go up once, when the step is reserved
(``begin``); each layer's K/V are written from the tensors' addresses by
two packed launches (``write``), and its attention runs a plan that was
made once (``attend``).  A short step (at most ``FIXED_COLUMNS`` query
columns a row, none of them padding: decode steps, the uncached tail of a
prompt whose prefix hit) uses the ``StepState`` of its shape, whose device
buffers the step refilled and whose plan was made once, so no launch of a
layer changes from one such step to the next (what a CUDA graph captured
at one step replays at the next, ``graphs.py``).

The slots and tables come from the rows' own bookkeeping (reserved
positions, block tables): the write is not checked again on the device
and never waits for it.
"""
import math

import torch

from .. import dtypes
from .._attention_args import _float32_real, _one_length, _positive_or_off, _real
from .torch_bridge import _NUMPY

# Blocks per row the first step state of a shape holds (at least): a state
# is remade, twice as large, when a row outgrows it (a new plan, and for
# graphs a new capture).
_MIN_CAPACITY = 16
# The most query columns a row of a step with a fixed StepState has: a
# decode step has 1, the first forward after a prefix hit at most a block
# (the hit leaves the last block, or part of one, to compute).  Below the
# 64 queries a row from which the CUDA backend plans prefill rows on the
# tensor-core kernel: a fixed plan's rows then all go to the split kernel.
FIXED_COLUMNS = 32


class DeviceLane:
    """The CUDA side of one :class:`PagedCache` (``cache._lane``)."""

    def __init__(self, step_lane, head_dim, torch_side):
        self._lane = step_lane
        self._torch = torch_side
        self._backend = step_lane.backend
        self._head_dim = head_dim
        self._io = getattr(self._backend, "attention_io_kinds", None)
        # blocks per row step states are made for (generate sets it from
        # the call's longest sequence, so one state lasts the whole call)
        self.capacity = 0

    # ------------------------------------------------------------ steps
    def begin(self, step, cache):
        """The step was reserved: its slots go up (and a short step's
        lengths and block tables, into the step state of its shape), in
        one copy, before any layer runs."""
        batch = len(cache._seqs)
        step.device = None
        if step.q <= FIXED_COLUMNS:
            step.attention_tables(cache)
            if step.query_rows is None:
                need = step.tables.shape[1]
                state = self._lane.step_state(batch, step.q, self.capacity_for(need))
                state.load(step.slots, step.seq_lens, step.tables)
                step.device = state
                step.device_slots = (state.slots, state.slots_ptr)
                return
        be = self._backend
        with be._ctx():
            slots = be.from_host(step.slots)
        step.device_slots = (slots, be._ptr(slots))

    def capacity_for(self, need):
        """Blocks per row of the step state for rows needing ``need``:
        ``capacity`` when it holds them, else a power of two."""
        if need <= self.capacity:
            return self.capacity
        return 1 << (max(need, _MIN_CAPACITY) - 1).bit_length()

    # ------------------------------------------------------------ layers
    def write(self, layer, key_states, value_states, step):
        """Layer ``layer``'s K/V ``(batch, heads, q, dim)`` into the step's
        slots: True when written, False when the lane cannot read them as
        they are (the caller then takes ``BlockPool.write``)."""
        side = self._torch
        k = side.kv_rows(key_states)
        if k is None:
            return False
        v = side.kv_rows(value_states)
        if v is None:
            return False
        return self._lane.write(layer, k, v, step.device_slots[1], step.slots.shape[0])

    def attend(self, step, key, layer, rows, out):
        """Attention of query rows ``rows`` ``(tokens, heads, dim)`` over
        ``layer`` into ``out`` (same shape and dtype, C-contiguous), with
        the step's plan for ``key`` = (scaling, sliding_window, softcap) as
        transformers passes them."""
        heads = rows.shape[1]
        plans = step.plans
        plan = plans.get((key, heads))
        if plan is None:
            checked = attention_key(key, self._head_dim)
            if step.device is not None:
                plan = step.device.plan(checked, heads)
            else:
                plan = self._lane.planned(step.tables, step.seq_lens, step.query_start,
                                          checked, heads)
            plans[(key, heads)] = plan
        kinds = self._io(plan) if self._io is not None else None
        q_kind = _KIND.get(rows.dtype)
        direct = kinds is not None and q_kind in kinds[0] and q_kind in kinds[1]
        q = rows if rows.is_contiguous() else rows.contiguous()
        if not direct:            # kernels that read and write float32 only
            q = q.float()
            target = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        else:
            target = out
        lane = self._lane
        reuse = step.device is not None
        q_ptr, out_ptr = q.data_ptr(), target.data_ptr()
        packs = lane.packed(plan, layer, _NUMPY[q.dtype], _NUMPY[target.dtype], q_ptr,
                            out_ptr) if reuse else None
        if packs is not None:     # a step state's plan's launches, packed: addresses only
            lane.attend_packed(packs, q_ptr, out_ptr)
        else:
            side, be = self._torch, self._backend
            lane.attend(plan, layer, side.device_array(q, be), side.device_array(target, be),
                        reuse=reuse)
        if target is not out:
            out.copy_(target)


_KIND = {torch.float32: dtypes.F32, torch.float16: dtypes.F16, torch.bfloat16: dtypes.BF16}


def attention_key(key, head_dim):
    """``(scale, window, cap)`` as the backend's plans take them (window
    and cap 0 when off) from transformers' (scaling, sliding_window,
    softcap), by the rules of :class:`kvcore.AttentionPlan`."""
    scaling, window, cap = key
    if scaling is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = _float32_real(_real(scaling, "scale"), "scale", allow_zero=True)
    window = _one_length(window, "sliding_window")
    cap = _positive_or_off(cap, "logits_soft_cap", _real, "positive")
    if cap:
        cap = _float32_real(cap, "logits_soft_cap", allow_zero=False)
    return float(scale), int(window), float(cap)
