"""The algorithms each collective offers, by name (what ``algo=`` accepts)."""

ALGOS = {
    "all_reduce": ("auto", "ring", "ring-seg", "recursive-doubling", "halving-doubling",
                   "native"),
    "reduce_scatter": ("auto", "ring", "ring-seg", "native"),
    "all_gather": ("auto", "ring", "ring-seg", "native"),
    "broadcast": ("ring", "pipelined", "native"),
    "reduce": ("ring", "pipelined", "native"),
}
# Collectives that reduce (and therefore take an op).
REDUCING = ("all_reduce", "reduce_scatter", "reduce")

#: The collectives whose "auto" or "ring-seg" may run the segmented ring.
SEGMENTED = ("all_reduce", "reduce_scatter", "all_gather")
