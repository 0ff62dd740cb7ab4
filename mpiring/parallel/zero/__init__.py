r"""ZeRO-style sharded optimizer on the ring's ReduceScatter and AllGather.

Data parallelism keeps K full copies of the optimizer state (for AdamW: two
floats per parameter, twice the model). ZeRO (Rajbhandari et al., 2020) removes
the redundancy: rank r keeps the state of only its shard of the parameters, and
the step becomes exactly the two halves of the lecture's Ring AllReduce::

    flat gradient  [ c0 | c1 | c2 | c3 ]      every rank, after backward
        ReduceScatter (ring)   ->  rank r holds chunk r summed over the ranks
        rank r: inner optimizer step on chunk r of the parameters, with the
                state of chunk r only (1/K of the state)
        AllGather (ring)       ->  every rank holds every updated chunk
    flat parameter [ c0 | c1 | c2 | c3 ]

* Stage 2 (default): the gradient is reduce-scattered, so each rank reduces and
  keeps only its chunk of the mean gradient. The wire carries ReduceScatter +
  AllGather = 2(K-1)/K of the model per rank: the same bytes as DDP's
  AllReduce, with 1/K of the state.
* Stage 1: the gradient is all-reduced (every rank gets the full mean gradient
  in ``p.grad``, as with DDP) and the state is still sharded; the parameter
  AllGather comes on top, 3(K-1)/K of the model per rank.

Layout. Parameters of one dtype and device are laid out back to back in one
flat buffer (a *segment*), and each parameter's ``.data`` becomes a view into
it, so the AllGather writes the new values straight into the model, without a
copy. The shard of rank r is chunk r of every segment with the ring's own
``numpy.array_split`` bounds (``comm.chunk_bounds``), so a shard may start or
end inside a parameter: the inner optimizer sees one 1-D view per piece of a
parameter that falls in the shard, and its per-element state (``exp_avg``...)
has the size of that piece.

Gradient averaging. Each rank divides its gradient by K *before* the sum
(``op="sum"`` on pre-divided values), as DDP does: a float16 or bfloat16 sum
of K gradients can overflow where the sum of K values divided by K cannot. For
K a power of two the division is exact, so this is bit-for-bit the mean.

With DDP (``ddp=``). Stage 2 registers a comm hook on the DDP model: each
bucket is reduce-scattered on the reducer's communication thread as soon as
backward fills it, overlapped with the rest of backward, and the segments are
the DDP buckets, so chunk r of each bucket is rank r's shard; ``step()`` then
reads its slices of ``p.grad`` in place and only updates and all-gathers. DDP
rebuilds its buckets after its first synced backward, so that one backward is
all-reduced and the first step lays the shards out like the rebuilt buckets.
Stage 1 leaves DDP's AllReduce alone and takes the means from ``p.grad``.
``no_sync()`` accumulates locally as with DDP; a step with no synced backward
since the last one raises instead of updating with unreduced gradients.

State dicts. ``consolidate_state_dict(to=0)`` (on every rank) assembles the
sharded state on rank ``to``, with the ring AllGather of every state tensor;
``state_dict()`` there returns it in the format of an unsharded optimizer
(``{"state": {index: {...}}, "param_groups": [...]}``, full-shape tensors), so it
does not depend on the world size: ``load_state_dict`` takes it on any number of
ranks (each rank keeps its own slice), and so does a plain ``torch.optim.AdamW``.

Interface after ``torch.distributed.optim.ZeroRedundancyOptimizer``, which shards
whole parameters and broadcasts them; this one shards a flat buffer, so the
shards are equal to one element whatever the parameter sizes.
"""

from mpiring.parallel.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
