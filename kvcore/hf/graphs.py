"""Decode steps as CUDA graphs: ``kvcore.hf.generate(..., cuda_graph=True)``.

A ``GraphRunner`` stands in for ``model.forward`` during a generate call.
Forwards of more than ``FIXED_COLUMNS`` query columns (prefill) and
anything unusual run eagerly.  A short forward (a decode step, one column
a row; or the uncached tail of a prompt whose prefix hit, at most a block)
is split in two:

* the host's part, done by the runner: the step is begun (positions
  reserved, slots mapped: the cache's bookkeeping), its slots, lengths and
  block tables go up into the ``StepState`` of its shape in one copy, and
  the step's input ids and positions are copied into the graph's input
  tensors;
* the device's part, the whole forward of the model with kvcore's writes
  and attention, replayed from a CUDA graph captured once per shape and
  step state; then the step is committed (``Step.wrote_all``).

Inside a captured step kvcore reads nothing back, allocates nothing and
copies nothing (its launches read the step state's buffers, the pool's
planes and torch's activations, at addresses that do not change); the
first step of a shape runs eagerly (it makes the state's attention plans
and warms the model up), the next one is captured.  Graphs, step states
and their input tensors are kept per pool and model (``GraphSet``), so a
later call replays at once: a prompt whose prefix is cached then has its
first token from a replayed step.  The graphs hold the addresses of the model's parameters and
buffers: a set checks them at each call and starts afresh if any moved.
"""
import threading
import weakref

import torch

from .cache import PagedCache
from .device import FIXED_COLUMNS
from .inputs import CACHE_KEYWORDS
from .step import Step

# Arguments a decode forward may carry into a graph: tensors copied into the
# graph's inputs at each replay (their shapes are part of the graph's key).
_INPUTS = ("input_ids", "position_ids", "cache_position")
# Where a captured call's arguments held the cache (the replaying call's goes there).
_THE_CACHE = object()
# Tensors that are read by nothing a captured step runs (kvcore's attention
# needs no mask: the cache knows every row's padding).
_IGNORED = ("attention_mask",)


class _Captured:
    """One captured step: the graph, its input tensors and output, and the
    capture's other tensor arguments (the attention mask: the graph holds
    their addresses; nothing it computes from them is used, but their
    memory must stay allocated while the graph may replay)."""

    __slots__ = ("graph", "inputs", "output", "kept", "cache_keys")

    def __init__(self, graph, inputs, output, kept):
        self.graph, self.inputs, self.output, self.kept = graph, inputs, output, kept
        # where the output names its cache (the capturing call's)
        keys = output.keys() if hasattr(output, "keys") else ()
        self.cache_keys = [k for k in CACHE_KEYWORDS if k in keys]

    def point_output_at(self, cache):
        """The output of a replay names ``cache`` (the replaying call's)."""
        for k in self.cache_keys:
            self.output[k] = cache


class GraphSet:
    """The graphs of one model over one pool, with the step states they
    read (a :class:`DeviceLane`): checked out by one generate call at a
    time."""

    def __init__(self, lane):
        self.lane = lane
        self.graphs = {}            # (key, state) -> _Captured
        self.warm = set()           # (key, state) that ran one eager step
        self.pool_handle = None     # torch's memory pool shared by the captures
        self.params = None          # (tensor, address) of the model's parameters and buffers
        self.runner = None          # the GraphRunner of the call holding the set
        self.busy = False
        self.captures = self.replays = 0

    def check_model(self, model):
        """Forget every graph if a parameter or buffer of ``model`` is not
        where the graphs read it (the tensors are held weakly: a dropped
        one fails the check)."""
        tensors = list(model.parameters()) + list(model.buffers())
        if self.params is None or len(self.params) != len(tensors) or any(
                t is not r() or t.data_ptr() != p for t, (r, p) in zip(tensors, self.params)):
            self.graphs.clear()
            self.warm.clear()
            self.params = [(weakref.ref(t), t.data_ptr()) for t in tensors]

    def forget_other_states(self, key, state):
        """Drop the graphs of ``key`` over step states other than ``state``
        (a state outgrown by longer sequences is never used again)."""
        for k in [k for k in self.graphs if k[0] == key and k[1] is not state]:
            del self.graphs[k]
        self.warm = {k for k in self.warm if k[0] != key or k[1] is state}

    def release(self):
        """The call holding the set ended: nothing here refers to its cache
        (whose pool keys the set's registry) any more."""
        self.runner = None
        for entry in self.graphs.values():
            entry.point_output_at(None)


_sets = weakref.WeakKeyDictionary()     # pool -> {model id: (weakref(model), GraphSet)}
_sets_lock = threading.Lock()


def checkout(pool, model, make_lane):
    """The ``GraphSet`` of (``pool``, ``model``) for one call (a fresh one
    when another call holds it); give it back with :func:`checkin`."""
    with _sets_lock:
        per_pool = _sets.setdefault(pool, {})
        for k in [k for k, (ref, _) in per_pool.items() if ref() is None]:
            del per_pool[k]          # a dropped model's graphs
        entry = per_pool.get(id(model))
        if entry is None or entry[0]() is not model:
            entry = per_pool[id(model)] = (weakref.ref(model), GraphSet(make_lane()))
        graph_set = entry[1]
        if graph_set.busy:
            return GraphSet(make_lane())
        graph_set.busy = True
        return graph_set


def counts(pool, model):
    """``(captures, replays)`` of the graphs kept for ``model`` over
    ``pool`` (``(0, 0)`` when none were made): for tests and benchmarks."""
    with _sets_lock:
        entry = _sets.get(pool, {}).get(id(model))
        if entry is None or entry[0]() is not model:
            return 0, 0
        return entry[1].captures, entry[1].replays


def checkin(graph_set):
    with _sets_lock:
        graph_set.release()
        graph_set.busy = False


def _new_graph():
    """A CUDA graph to capture into (the tests' host emulation of the CUDA
    backend puts a stand-in here)."""
    return torch.cuda.CUDAGraph()


def _capture(graph, pool_handle, run):
    """Capture ``run()`` into ``graph`` on a side stream (torch.cuda.graph):
    its result (the step's output, in the graph's memory).  (The tests'
    emulation puts a stand-in here with ``_new_graph``'s.)"""
    with torch.cuda.graph(graph, pool=pool_handle):
        return run()


def _graph_pool():
    return torch.cuda.graph_pool_handle()


class GraphRunner:
    """``model.forward`` for one generate call with ``cuda_graph=True``."""

    def __init__(self, model, forward, cache, graph_set):
        self._forward = forward
        self._cache = cache
        self._set = graph_set
        self._model = model
        graph_set.runner = self

    def __call__(self, *args, **kwargs):
        cache = self._cache
        key = self._decode_key(args, kwargs)
        if key is None:
            return self._forward(*args, **kwargs)
        # the step's copy up goes on torch's current stream, as its replay
        with cache._torch.stream():
            step = Step.begin(cache, key[0], key[1])
        try:
            state = step.device
            gs = self._set
            if state is None:                  # (padding among the queries: no fixed state)
                return self._forward(*args, **kwargs)
            entry = gs.graphs.get((key, state))
            if entry is None and (key, state) not in gs.warm:
                # the first step of this state runs eagerly: it makes the
                # state's attention plans (uploads) and warms the model up
                # (on a side stream, as torch's graph examples do)
                out = self._warm_up(args, kwargs)
                gs.warm.add((key, state))
                return out
            if entry is None:
                gs.forget_other_states(key, state)
                entry = gs.graphs[(key, state)] = self._capture(kwargs)
                gs.captures += 1
            else:
                for name, t in entry.inputs.items():
                    t.copy_(kwargs[name])
            entry.graph.replay()
            gs.replays += 1
            step.wrote_all(cache)
            entry.point_output_at(cache)
            return entry.output
        except BaseException:
            step.rollback(cache)
            raise

    def _warm_up(self, args, kwargs):
        return self._cache._torch.on_side_stream(lambda: self._forward(*args, **kwargs))

    def _decode_key(self, args, kwargs):
        """The graph key of a short forward (batch, columns, then each
        input's name and shape, then the other arguments), or None: run it
        eagerly."""
        cache = self._cache
        if args or kwargs.get("inputs_embeds") is not None:
            return None
        ids = kwargs.get("input_ids")
        side = cache._torch
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 \
                or not 1 <= ids.shape[1] <= FIXED_COLUMNS or not side.holds(ids):
            return None
        if not isinstance(kwargs.get("position_ids"), torch.Tensor):
            return None     # (the model would bake positions from the host into the graph)
        if not cache._seqs or (cache._step is not None and not cache._step.complete):
            return None
        if getattr(self._model.config, "_attn_implementation", None) != "kvcore":
            return None
        key = [int(ids.shape[0]), int(ids.shape[1])]
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                if name in _IGNORED:
                    continue
                if name not in _INPUTS or not side.holds(value):
                    return None
                key.append((name, tuple(value.shape), value.dtype))
            elif name in CACHE_KEYWORDS and value is not None:
                if value is not cache:
                    return None     # (another cache's forward: the model as its own assistant)
            elif name in ("output_attentions", "output_hidden_states") and value:
                return None
            else:
                try:
                    hash(value)
                except TypeError:
                    return None
                key.append((name, value))
        return tuple(key)

    def _capture(self, kwargs):
        """Capture this step's forward (the step is begun, its buffers
        loaded): kvcore's part issues launches only (``cache._captured``)."""
        gs = self._set
        inputs = {name: kwargs[name].clone() for name in _INPUTS
                  if isinstance(kwargs.get(name), torch.Tensor)}
        # (the cache by a mark: a graph set outlives its calls' caches)
        call = {name: _THE_CACHE if isinstance(value, PagedCache) else value
                for name, value in dict(kwargs, **inputs).items()}
        if gs.pool_handle is None:
            gs.pool_handle = _graph_pool()
        graph = _new_graph()

        def run():
            # the step's forward with kvcore issuing launches only (for a
            # stand-in graph, whose replay runs it again: on the cache of
            # the call that holds the set then)
            runner = gs.runner
            now = runner._cache
            now._captured = True
            try:
                return runner._forward(**{name: now if value is _THE_CACHE else value
                                          for name, value in call.items()})
            finally:
                now._captured = False

        output = _capture(graph, gs.pool_handle, run)
        kept = [v for v in call.values() if isinstance(v, torch.Tensor)]
        return _Captured(graph, inputs, output, kept)
