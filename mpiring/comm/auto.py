"""What ``algo="auto"`` and the pipelined collectives' default S run, chosen alike on every rank."""

from __future__ import annotations

from mpiring.core.buffers import Buffer

#: Most sizes a Communicator remembers auto's choice and the pipeline's S for
#: (a training loop repeats a handful; a sweep over many sizes just stops adding).
_REMEMBER = 4096


class AutoChoice:
    """The Communicator's choice of algorithm and chunk count (a mixin of ``Communicator``)."""

    @property
    def _auto(self):
        return self._auto_table

    @_auto.setter
    def _auto(self, table) -> None:  # a new (or refitted) table: forget the old choices
        self._auto_table = table
        self._auto_seen = {}
        self._chunks_seen = {}

    def _auto_algo(self, collective: str, buf: Buffer, op: str | None) -> str:
        """What ``algo="auto"`` runs: a function of values equal on every rank.

        The first auto call on a communicator takes rank 0's table to every rank
        (two small exchanges, see ``mpiring.comm.autotune``); every rank then looks up
        the same (collective, bytes) in the same table, so all choose alike. A
        training loop repeats its sizes, so each choice is remembered: the usual
        call costs one dictionary lookup. That matters where messages are small
        and ranks share cores: there 0.1 us more per call measured as 0.3-1 us
        more per collective, the ranks' delays adding up.
        """
        key = (collective, buf.array.nbytes, buf.dtype, op)
        algo = self._auto_seen.get(key)
        if algo is None:
            algo = self._auto_choose(collective, buf, op)
            if len(self._auto_seen) < _REMEMBER:
                self._auto_seen[key] = algo
        self._act.algo = algo  # the stall report names the algorithm that runs
        return algo

    def _auto_choose(self, collective: str, buf: Buffer, op: str | None) -> str:
        # Only mpiring's own algorithms: the library's collective runs when it is
        # asked for by name, so the default call is always code a reader can see
        # (and ``--log steps`` always has steps to print).
        return self._tuned().choose(collective, buf.nbytes, native_ok=False)

    def _tuned(self):
        if self._auto is None:  # collective: every rank's first call that needs it
            from mpiring.comm.autotune import shared_table

            self._auto = shared_table(self)
        return self._auto

    def _pipeline_chunks(self, buf: Buffer, algo: str, chunks: int | None) -> int:
        if algo == "ring":
            return 1
        if chunks is not None:
            return int(chunks)
        return self.pipeline_chunks(buf.nbytes)

    def pipeline_chunks(self, nbytes: int) -> int:
        """The chunks S a pipelined broadcast or reduce of ``nbytes`` uses by default.

        The cost model's best S (``mpiring.core.costmodel``), with the alpha and beta
        that ``tune`` stored for this layout, else the built-in ones; 1 on two
        ranks or for an empty message (nothing to overlap). The first call loads
        rank 0's table, so it is collective: call it on every rank.
        """
        if self.size <= 2 or nbytes == 0:
            return 1
        # Remembered per size: working S out costs about 6 us, and where ranks share
        # cores that made a 1 MiB broadcast 10-20% slower than the same S given.
        s = self._chunks_seen.get(nbytes)
        if s is None:
            s = self._tuned().pipeline_chunks(int(nbytes), self.size)
            if len(self._chunks_seen) < _REMEMBER:
                self._chunks_seen[nbytes] = s
        return s
