"""Point-to-point: send, recv, isend, irecv, sendrecv and groups, on both backends.

What pipeline parallelism stands on. Each message is one call on each side::

    rank 0: comm.send(x, dst=1, tag=3)      rank 1: comm.recv(y, src=0, tag=3)

Messages from one rank to another with the same tag arrive in the order they
were sent. The ring collectives do not use these calls (they talk to the
backend directly, with a tag of their own), so the two kinds of traffic never
match each other.

With the argument check on (the communicator's ``check``, default on), every
message carries a 24-byte descriptor (bytes, dtype, count) ahead of its data,
and the receiver compares it with its own buffer before it accepts the data: a
size or dtype that differs is a ``MismatchError`` naming both sides, not
garbage in the buffer. Both ends must agree on the setting (``MPIRING_CHECK``
is the same on every rank unless you make it differ).

A receive may take its message from any source (``comm.recv(x, None)``, MPI's
ANY_SOURCE; the MPI backend only: NCCL has no such receive, so it is refused
before anything is posted). ``req.source`` names the sender once the request is
complete. Each sender's messages still arrive in the order it sent them, and
only messages with the receive's tag match. With the check on, the data is
received from the sender whose descriptor arrived, never another's; it is
posted once that descriptor is in, so a large message's sender may wait in
``send`` until the receiver waits for, tests or posts a point-to-point message
of this communicator.

Every wait has the communicator's deadline; a receive that nothing matches ends
in a stall report naming the peer (or "any source") and the tag. Every
completed message is one trace record (``type: "p2p"``; from any source: the
sender as ``peer`` and ``"any_source": true``) and, with ``--log steps``, one
log line.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from mpiring.backends import MAX_TAG
from mpiring.backends.gpu import device_ready, from_host, host_dtype, to_host
from mpiring.comm.prepare import _is_int
from mpiring.core.buffers import DTYPES, Buffer, as_buffer
from mpiring.core.errors import MismatchError
from mpiring.runtime.trace import clock


class Request:
    """A message in flight, from ``isend``/``irecv``: ``wait()`` completes it, ``test()`` asks."""

    __slots__ = ("_comm", "_op", "_buf", "_peer", "_tag", "_handle", "_staged", "_t0", "_call",
                 "_done", "_header", "_keep", "_obj")

    def __init__(self, comm, op: str, buf: Buffer, peer: int, tag: int, call: int, obj=None):
        self._comm, self._op, self._buf, self._peer, self._tag = comm, op, buf, peer, tag
        self._call, self._t0, self._done = call, clock(), False
        self._handle = self._staged = self._header = self._keep = None
        self._obj = buf.obj if obj is None else obj  # what ``wait`` hands back

    @property
    def what(self) -> str:
        arrow = "to" if self._op == "send" else "from"
        peer = "any source" if self._peer is None else f"r{self._peer}"
        return f"{self._op}#{self._call} {arrow} {peer} tag {self._tag}"

    @property
    def source(self) -> int:
        """The sender's rank (in this communicator) of a receive; from any source,
        known once the request is complete (``wait()``, or ``test()`` True).

        Raises:
            ValueError: a send's request, or a receive from any source not complete yet.
        """
        if self._op != "recv":
            raise ValueError(f"{self.what}: a send has no source; only a receive's "
                             "request names one")
        if self._peer is not None:
            return self._peer
        if not self._done:
            raise ValueError(f"{self.what}: the sender is known once the message is in: "
                             "call wait() first (or test() until it is True)")
        return self._handle.peer

    def wait(self):
        """Block until the message has left (send) or arrived (recv); returns the buffer."""
        if not self._done:
            handle = self._handle
            if not getattr(handle, "settled", False):  # else ``test`` saw it complete
                comm = self._comm
                comm._act.begin(self._op, self._call, None)  # what a stall report names
                comm._be.complete(handle, f"Wait({self.what})", self._peer)
            self._done = True
            if self._staged is not None:  # a CUDA buffer received through host memory
                from_host(self._buf.array, self._staged)
            self._comm._record(self)
        return self._obj

    def test(self) -> bool:
        """True once the message is complete (then ``wait`` returns at once); never blocks."""
        if not self._done and self._comm._be.done(self._handle):
            self.wait()
        return self._done

    def is_completed(self) -> bool:
        """``test()`` under torch's name for it (a Work's ``is_completed``)."""
        return self.test()


class _Sent:
    """What a prepared send's Request records of its message: not the prepared tensor,
    which the caller may free (its Buffer would keep it alive as long as the prepared send)."""

    __slots__ = ("obj", "dtype", "nbytes", "count", "device", "array")

    def __init__(self, buf: Buffer):
        self.obj, self.array = None, None
        self.dtype, self.nbytes, self.count, self.device = (buf.dtype, buf.nbytes, buf.count,
                                                            buf.device)


class PreparedSend:
    """Sends of tensors shaped like one buffer to one peer and tag, checked once.

    ``comm.prepare_send(like, dst, tag)`` does what ``isend`` does before each
    message (wrap the buffer, check peer, tag and dtype, build the descriptor)
    once; ``post(x)`` then only checks that ``x`` has ``like``'s dtype, size and
    layout and posts it. On the MPI backend a CPU tensor goes as its data
    pointer: right after the compute that made it, wrapping a tensor for MPI
    costs several times the message itself. Each message is a ``Request``,
    traced and waited for under the deadline like any other. ``like`` itself
    is not kept.
    """

    __slots__ = ("_comm", "_peer", "_tag", "_meta", "_raw", "_header", "_dtype")

    def __init__(self, comm, like, dst: int, tag: int):
        self._comm, self._peer, self._tag = comm, check_peer(comm, dst, "dst"), check_tag(tag)
        buf = send_buffer(like)
        if getattr(comm._be, "accepts_cuda", False):  # NCCL: device memory only, said now
            comm._be.check_buffer(buf, "send", "p2p", None)
        self._meta, self._header = _Sent(buf), descriptor(buf)
        # The pointer path: a torch CPU tensor on a backend that sends raw host bytes.
        self._raw = (buf.kind == "torch" and buf.device == "cpu"
                     and getattr(comm._be, "host_buffer", None) is not None)
        self._dtype = getattr(like, "dtype", None)

    def post(self, x) -> Request:
        """Start sending ``x`` (the prepared dtype and size, contiguous); returns its Request.

        Raises:
            ValueError: ``x`` is not like the prepared buffer (nothing is sent).
        """
        meta, comm = self._meta, self._comm
        if not self._raw:
            got = send_buffer(x)
            if got.dtype != meta.dtype or got.count != meta.count or got.device != meta.device:
                raise self._unlike(x)
            return comm._post("send", x, self._peer, self._tag, got)
        try:
            unlike = (x.dtype is not self._dtype or x.numel() != meta.count or not x.is_cpu
                      or not x.is_contiguous() or x.requires_grad)
        except AttributeError:  # not a tensor at all
            unlike = True
        if unlike:
            raise self._unlike(x)
        # The message first, the bookkeeping while it travels (right after a compute
        # action every step here runs cold).
        be = comm._be
        if comm._group_reqs:
            _check_group_overlap(comm._group_reqs, None, x, self.what)
        header = self._header if comm.check else None
        handle = be.post_send(be.host_buffer(x.data_ptr(), meta.nbytes), self._peer,
                              self._tag, header)
        comm._p2p_calls += 1
        req = Request(comm, "send", meta, self._peer, self._tag, comm._p2p_calls, obj=x)
        req._keep, req._header, req._handle = x, header, handle  # x: read until complete
        if comm._group_reqs is not None:
            comm._group_reqs.append(req)
        return req

    @property
    def what(self) -> str:
        return f"prepared send to r{self._peer} tag {self._tag}"

    def _unlike(self, x) -> ValueError:
        meta = self._meta
        what = (f"{getattr(x, 'dtype', type(x).__name__)} of shape "
                f"{tuple(getattr(x, 'shape', ()))}")
        if getattr(x, "requires_grad", False):
            what += " that requires grad (pass x.detach())"
        return ValueError(
            f"[r{self._comm.rank}] prepared send to r{self._peer} tag {self._tag}: got {what}, "
            f"prepared for {meta.count} x {meta.dtype} on {meta.device}, contiguous; prepare "
            "a send for this one (comm.prepare_send(x, dst, tag))")


class PreparedRecv:
    """Receives into one buffer from one peer and tag, checked once (``comm.prepare_recv``).

    ``post()`` starts the next receive into the buffer: no wrapping and no
    checks, only the post. The buffer must not be read between ``post()`` and
    the request's completion.
    """

    __slots__ = ("_comm", "_peer", "_tag", "_buf", "_fast")

    def __init__(self, comm, buf, src: int, tag: int):
        if src is None:
            raise ValueError("prepare_recv: src=None: a prepared receive names its sender; "
                             "for a message from any source use comm.irecv(x, None, tag)")
        self._comm, self._peer, self._tag = comm, check_peer(comm, src, "src"), check_tag(tag)
        self._buf = as_buffer(buf)
        if getattr(comm._be, "accepts_cuda", False):  # NCCL: device memory only, said now
            comm._be.check_buffer(self._buf, "recv", "p2p", None)
        # Host memory on a host backend; device memory and NCCL take the general path
        # (its staging, stream and buffer rules).
        self._fast = self._buf.device == "cpu" and not getattr(comm._be, "accepts_cuda", False)

    @property
    def buffer(self):
        """The caller's buffer, as it was given."""
        return self._buf.obj

    def post(self) -> Request:
        """Start receiving the next message into the buffer; returns its Request."""
        comm, buf = self._comm, self._buf
        if not self._fast:
            return comm._post("recv", buf.obj, self._peer, self._tag)
        comm._p2p_calls += 1
        req = Request(comm, "recv", buf, self._peer, self._tag, comm._p2p_calls)
        return comm._issue(req, buf, buf.array)


def send_buffer(x) -> Buffer:
    """``as_buffer(x)`` for a buffer that is only read (a send): read-only NumPy memory
    (``np.frombuffer`` of bytes, ``setflags(write=False)``, a read-only memmap) is fine.
    """
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        flags = x.flags
        # as_buffer refuses it only for being read-only when everything else is in order
        # (a dtype it reduces, aligned, native byte order, contiguous); MPI sends from
        # read-only memory. Anything else wrong: as_buffer's own error names it.
        if (flags.c_contiguous and flags.aligned and x.dtype.isnative
                and x.dtype.name in DTYPES):
            return Buffer(x, x.reshape(-1), x.dtype.name, "cpu", "numpy")
    return as_buffer(x)


def _check_group_overlap(reqs: list, req, array, what: str | None = None) -> None:
    """Refuse a message whose memory overlaps a message of the other direction in the
    open group, before it is posted.

    Everything in a group is in flight at once: a receive into memory that a send
    of the same group still reads can land before the send has read it (a large
    message is read only when the peer is ready), and the peer then gets our new
    data instead of the old. Nothing raises and the result is silently wrong, so
    refuse it here.
    """
    op = "send" if req is None else req._op
    for other in reqs:
        if other._op != op and other._keep is not None and _overlap(array, other._keep):
            mine = what if req is None else req.what
            raise ValueError(
                f"[r{other._comm.rank}] {mine}: its buffer overlaps that of {other.what} in "
                "the same group, so the receive could overwrite what the send has not read "
                "yet; use comm.sendrecv(x, dst, x, src) (it sends a copy), or receive into "
                "another buffer")


def _span(a) -> tuple[bool, int, int]:
    """(on the host?, first byte, end) of the memory a message reads or fills."""
    if isinstance(a, np.ndarray):
        start = a.__array_interface__["data"][0]
        return True, start, start + a.nbytes
    if hasattr(a, "data_ptr"):  # a torch tensor (a prepared send's raw path)
        start = a.data_ptr()
        return a.device.type == "cpu", start, start + a.numel() * a.element_size()
    start = a.data.ptr  # a CuPy array
    return False, start, start + a.nbytes


def _overlap(a, b) -> bool:
    """Whether the memory of two contiguous buffers (NumPy or CuPy arrays, torch
    tensors) shares bytes."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        # Bounds only: exact for contiguous arrays, and the cheapest test there is.
        return np.may_share_memory(a, b)
    host_a, lo_a, hi_a = _span(a)
    host_b, lo_b, hi_b = _span(b)
    return host_a == host_b and lo_a < hi_b and lo_b < hi_a and lo_a < hi_a and lo_b < hi_b


def _check_any_source(comm, tag) -> None:
    """Refuse a receive from any source where the backend has none (NCCL), before
    anything is posted; the MPI backend takes it."""
    if not getattr(comm._be, "any_source", False):
        raise ValueError(
            f"[r{comm.rank}] recv from any source tag {tag!r}: the {comm.backend} backend has "
            "no receive from any source (NCCL matches every receive to one peer); post "
            "a receive per possible sender instead (comm.irecv(buf_r, r, tag) for each "
            "rank r that may send, then wait for them), or use the MPI backend")


def check_peer(comm, peer, name: str) -> int:
    if not _is_int(peer) or not 0 <= peer < comm.size:
        raise ValueError(f"{name}={peer!r} out of range: use a rank in 0..{comm.size - 1} "
                         f"of this {comm.size}-rank communicator")
    return int(peer)


def check_tag(tag) -> int:
    if not _is_int(tag) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag={tag!r}: use an integer in 0..{MAX_TAG}")
    return int(tag)


def descriptor(buf: Buffer) -> np.ndarray:
    """What the receiver checks: bytes, dtype (index into ``DTYPES``) and count."""
    return np.array([buf.nbytes, DTYPES.index(buf.dtype), buf.count], dtype=np.int64)


def describe(desc) -> str:
    nbytes, dtype, count = (int(v) for v in desc)
    name = DTYPES[dtype] if 0 <= dtype < len(DTYPES) else "?"
    return f"{count} x {name} ({nbytes} B)"


class PointToPoint:
    """The Communicator's point-to-point calls (a mixin: it uses ``_be``, ``rank``, ``size``,
    ``check``, ``tracer`` and ``_act``)."""

    _group_reqs: list | None = None
    _p2p_calls = 0

    def _post(self, op: str, x, peer: int, tag: int, buf: Buffer | None = None) -> Request:
        if buf is None:
            buf = send_buffer(x) if op == "send" else as_buffer(x)
        if peer is None and op == "recv":  # from any source (None: MPI_ANY_SOURCE)
            _check_any_source(self, tag)
        else:
            peer = check_peer(self, peer, "dst" if op == "send" else "src")
        tag = check_tag(tag)
        self._p2p_calls += 1
        req = Request(self, op, buf, peer, tag, self._p2p_calls)
        self._act.begin(op, self._p2p_calls, None)
        array = buf.array
        if getattr(self._be, "accepts_cuda", False):
            # NCCL: device memory only, enqueued on the caller's current CuPy stream,
            # so it runs after the work that produced the buffer.
            self._be.check_buffer(buf, op, "p2p", None)
        elif buf.device == "cuda" and _cuda_aware():
            device_ready(array)  # MPI reads device memory without looking at any stream
        elif buf.device == "cuda":
            # The MPI library cannot read device memory: each message goes through a
            # host copy of its own, so that messages in flight never share one.
            array = to_host(array) if op == "send" else np.empty(buf.count,
                                                                  dtype=host_dtype(buf.dtype))
            req._staged = None if op == "send" else array
        req = self._issue(req, buf, array)
        if buf.kind == "torch" and getattr(self._be, "accepts_cuda", False):
            self._be.follow_torch_stream(req._handle, buf)
        return req

    def _issue(self, req: Request, buf: Buffer, array) -> Request:
        """Hand ``req``'s message (``array``: the memory the backend reads or fills) to the
        backend, with the descriptor when the check is on; join the open group."""
        if self._group_reqs:
            _check_group_overlap(self._group_reqs, req, array)
        req._keep = array  # the backend reads or fills it until the message completes
        mine = descriptor(buf) if self.check else None
        if req._op == "send":
            req._handle = self._be.post_send(array, req._peer, req._tag, mine)
        else:
            got = None if mine is None else np.empty(3, dtype=np.int64)
            check = None if got is None else (lambda: self._compare(req, mine, got))
            req._handle = self._be.post_recv(array, req._peer, req._tag, got, check)
        req._header = mine
        if self._group_reqs is not None:
            self._group_reqs.append(req)
        return req

    def _compare(self, req: Request, mine: np.ndarray, got: np.ndarray) -> None:
        if not np.array_equal(mine, got):
            # From any source, the backend's message has learnt the sender by now.
            sender = req._peer if req._peer is not None else req._handle.peer
            raise MismatchError(
                f"[r{self.rank}] {req.what}: r{sender} sent {describe(got)}, this rank "
                f"receives into {describe(mine)}; give both ends the same size and dtype")

    def _record(self, req: Request) -> None:
        if self.tracer.enabled:
            if req._peer is None:  # from any source: the sender, and how it was received
                self._trace_p2p(req._op, req._call, req._handle.peer, req._tag,
                                req._buf.nbytes, req._buf.dtype, req._t0, any_source=True)
                return
            self._trace_p2p(req._op, req._call, req._peer, req._tag, req._buf.nbytes,
                            req._buf.dtype, req._t0)

    def record_message(self, op: str, peer: int, tag: int, nbytes: int, dtype: str,
                       t_start: float, via: str) -> None:
        """One point-to-point trace record for a message that did not go through
        ``isend``/``irecv`` (``via`` says how it went)."""
        self._p2p_calls += 1
        if self.tracer.enabled:
            self._trace_p2p(op, self._p2p_calls, peer, tag, nbytes, dtype, t_start, via=via)

    def _trace_p2p(self, op: str, call: int, peer: int, tag: int, nbytes: int, dtype: str,
                   t_start: float, **extra) -> None:
        # The job rank, as a step record's, and the communicator (its job ranks, once
        # per file), so that a pipeline group's peer, a rank of that group, reads as a
        # job rank in the tools and the log.
        self.tracer.write({"type": "p2p", "rank": self.tracer.rank, "op": op, "call": call,
                           "peer": peer, "comm": self.tracer.group_id(self), "tag": tag,
                           "bytes": nbytes, "dtype": dtype, **extra,
                           "t_start": t_start, "t_end": clock()})

    def isend(self, x, dst: int, tag: int = 0) -> Request:
        """Start sending ``x`` to rank ``dst``; ``x`` must stay unchanged until ``wait()``.

        Raises:
            ValueError/TypeError: a bad buffer, a peer out of range or a bad tag,
                before anything is sent.
        """
        return self._post("send", x, dst, tag)

    def irecv(self, x, src: int | None, tag: int = 0) -> Request:
        """Start receiving into ``x`` from rank ``src``; ``wait()`` returns ``x`` filled.

        ``src=None``: from any rank (MPI backend only); the request's ``source``
        then names the sender once it is complete. The sender's message must have
        ``x``'s size and dtype (with the check on, a difference raises
        ``MismatchError`` at ``wait()``, naming the sender).

        Raises:
            ValueError: ``src=None`` on the NCCL backend (before anything is posted).
        """
        return self._post("recv", x, src, tag)

    def prepare_send(self, like, dst: int, tag: int = 0) -> PreparedSend:
        """Check once what sends of buffers like ``like`` to ``dst`` on ``tag`` need.

        ``prepared.post(x)`` then starts one such send and returns its Request:
        the cheap path for a message that goes out again and again (a pipeline's
        activations), each one still traced and deadline-checked.
        """
        return PreparedSend(self, like, dst, tag)

    def prepare_recv(self, buf, src: int, tag: int = 0) -> PreparedRecv:
        """Check once what receives into ``buf`` from ``src`` on ``tag`` need;
        ``prepared.post()`` then starts one and returns its Request."""
        return PreparedRecv(self, buf, src, tag)

    def send(self, x, dst: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst`` and return once it has left ``x``."""
        self.isend(x, dst, tag).wait()

    def recv(self, x, src: int | None, tag: int = 0):
        """Receive into ``x`` from rank ``src`` (None: any rank), in place; returns ``x``.

        For the sender of a message from any rank, use ``irecv``: ``req.wait()``,
        then ``req.source``.
        """
        return self.irecv(x, src, tag).wait()

    def sendrecv(self, send_x, dst: int, recv_x, src: int, tag: int = 0):
        """Send ``send_x`` to ``dst`` while receiving ``recv_x`` from ``src``; returns ``recv_x``.

        Both go out together (one group), so a ring of sendrecvs cannot deadlock.
        ``recv_x`` may be ``send_x`` itself, or overlap it (MPI_Sendrecv_replace):
        the message sent is then a copy of ``send_x`` taken before anything arrives.
        """
        # Both wrapped (and so checked) before either is posted: a bad send buffer
        # must not leave a receive posted behind it.
        send_buf, recv_buf = send_buffer(send_x), as_buffer(recv_x)
        if _overlap(send_buf.array, recv_buf.array):
            # The receive would overwrite what the send still reads: a large message
            # (rendezvous) is read from our memory only once the peer is ready, by
            # which time our own receive may have landed in it. So send a copy,
            # taken before the receive is posted (MPI_Sendrecv_replace does the same).
            send_buf = send_buffer(send_buf.array.copy())
        with self.group():
            self._post("recv", recv_x, src, tag, recv_buf)
            self._post("send", send_buf.obj, dst, tag, send_buf)
        return recv_x

    @contextmanager
    def group(self):
        """Issue the point-to-point calls made inside the block together; complete them at its end.

        On NCCL this is ncclGroupStart/ncclGroupEnd: a send and the receive it must
        overlap with go in one group, or both neighbours block. On MPI every call is
        issued at once and the block's end waits for all of them. Groups nest (the
        outermost one completes everything).
        """
        if self._group_reqs is not None:  # nested: the outer group completes them
            yield
            return
        self._group_reqs = reqs = []
        try:
            yield
        finally:
            self._group_reqs = None
        self._be.flush()
        for req in reqs:
            req.wait()


def _cuda_aware() -> bool:
    from mpiring.backends.gpu import cuda_aware_mpi

    return cuda_aware_mpi()[0]
