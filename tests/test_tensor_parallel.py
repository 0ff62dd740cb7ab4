"""Tensor parallelism: every layer against its unsplit torch twin, float64, K = 1..4 and 5.

The reference runs on every rank without communication (same seeded full
inputs everywhere); each rank checks the forward, the input gradient and its
own slice of the weight gradient. Sizes do not divide by the rank counts
(13, 17, 37, 7 tokens), and a tiny case leaves some ranks with nothing.
The odd 5-rank world runs this file's ``world`` cases in a nested job.
"""

from __future__ import annotations

import pytest
import torch
from mpi_harness import run_by_part_of_the_job
from torch import nn
from torch.nn import functional as F

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.tensor import (
    ColumnParallelLinear,
    RNGStreams,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_gather_forward_reduce_scatter_backward,
    all_gather_forward_split_backward,
    all_reduce_in_backward,
    all_reduce_in_forward,
    reduce_scatter_forward_all_gather_backward,
    shard_ranges,
    split_forward_all_gather_backward,
    vocab_parallel_cross_entropy,
)

SEQ, BATCH = 7, 2
SEQS = [7, 8]  # tokens: an uneven and an even split over 2 and 4 ranks
SHAPES = [(13, 17), (5, 3)]  # (in, out): uneven everywhere; 3 outputs leave rank 3 of 4 empty
TIGHT = dict(rtol=1e-11, atol=1e-12)


@pytest.fixture(params=["K1", "K2", "K3", "K4", "world"])
def tp(request, subcomms, world):
    """A tensor-parallel group: K = 1..4 (sub-communicators), or the whole job if it has 5+."""
    if request.param == "world":
        if world.size <= 4:
            pytest.skip("the whole job is one of K1..K4 (the nested 5-rank job runs this case)")
        return world
    k = int(request.param[1:])
    if k < world.size:
        run_by_part_of_the_job(request.node)
    if k > world.size or subcomms[k] is None:
        pytest.skip(f"rank {world.rank} is not in the {k}-rank group")
    return subcomms[k]


def full(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """The same float64 tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale)


def rows(comm, n: int) -> slice:
    lo, hi = chunk_bounds(n, comm.size)[comm.rank]
    return slice(lo, hi)


def cols(t: torch.Tensor, ranges) -> torch.Tensor:
    return torch.cat([t[..., lo:hi] for lo, hi in ranges], dim=-1)


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"{what}: {m}")


# --- the operators, with rank-dependent data ------------------------------------------
def test_f_and_g_sum_over_the_group(tp):
    k, r = tp.size, tp.rank
    x = (torch.arange(10, dtype=torch.float64) + 100 * r).requires_grad_()
    y = all_reduce_in_backward(x, tp)
    close(y.detach(), x.detach(), "f forward is the identity")
    y.backward(torch.arange(10, dtype=torch.float64) * (r + 1))
    close(x.grad, torch.arange(10, dtype=torch.float64) * (k * (k + 1) / 2), "f backward sums")

    x = (torch.arange(10, dtype=torch.float64) + 100 * r).requires_grad_()
    y = all_reduce_in_forward(x, tp)
    close(y.detach(), torch.arange(10, dtype=torch.float64) * k + 100 * k * (k - 1) / 2, "g sums")
    g = torch.full((10,), float(r + 3), dtype=torch.float64)
    y.backward(g)
    close(x.grad, g, "g backward is the identity")


def _per_rank(k: int, n: int, width: int, salt: int) -> list[torch.Tensor]:
    """Rank i's full-length tensor: index- and rank-dependent, the same on every rank."""
    return [torch.arange(n * width, dtype=torch.float64).view(n, width) * (i + 1) + 1000 * i + salt
            for i in range(k)]


@pytest.mark.parametrize("n", [0, 1, SEQ, 12])
def test_sequence_gather_and_reduce_scatter_are_adjoint(tp, n):
    k, r = tp.size, tp.rank
    sizes = [hi - lo for lo, hi in chunk_bounds(n, k)]
    mine = rows(tp, n)
    xs = _per_rank(k, n, 3, salt=1)
    x = xs[r][mine].clone().requires_grad_()
    y = all_gather_forward_reduce_scatter_backward(x, tp, 0, sizes)
    close(y.detach(), torch.cat([xs[i][rows_of(k, i, n)] for i in range(k)]), "gather")
    grads = _per_rank(k, n, 3, salt=7)
    y.backward(grads[r])
    close(x.grad, sum(grads)[mine], "backward reduce-scatters")

    x = xs[r].clone().requires_grad_()
    y = reduce_scatter_forward_all_gather_backward(x, tp, 0)
    close(y.detach(), sum(xs)[mine], "reduce-scatter")
    y.backward(grads[r][mine])
    close(x.grad, torch.cat([grads[i][rows_of(k, i, n)] for i in range(k)]), "backward gathers")


def test_feature_reduce_scatter_is_contiguous_and_sums(tp):
    k, r, n = tp.size, tp.rank, 11
    xs = [torch.arange(2 * 3 * n, dtype=torch.float64).view(2, 3, n) * (i + 1) - i
          for i in range(k)]
    x = xs[r].clone().requires_grad_()
    y = reduce_scatter_forward_all_gather_backward(x, tp, -1, [hi - lo for lo, hi in
                                                              chunk_bounds(n, k)])
    close(y.detach(), sum(xs)[..., rows(tp, n)], "reduce-scatter along the last dim")
    assert y.is_contiguous(), y.stride()
    assert y.view(-1).numel() == y.numel()


def rows_of(k: int, i: int, n: int) -> slice:
    lo, hi = chunk_bounds(n, k)[i]
    return slice(lo, hi)


def test_feature_gather_and_split_are_adjoint(tp):
    k, r = tp.size, tp.rank
    n = 11
    sizes = [hi - lo for lo, hi in chunk_bounds(n, k)]
    whole = torch.arange(2 * 3 * n, dtype=torch.float64).view(2, 3, n)
    mine = whole[..., rows(tp, n)]
    x = mine.clone().requires_grad_()
    y = all_gather_forward_split_backward(x, tp, -1, sizes)
    close(y.detach(), whole, "gather along the last dim")
    g = whole * 0.5 + 3
    y.backward(g)
    close(x.grad, g[..., rows(tp, n)], "its backward keeps this rank's columns")

    # Contiguous, as nn.Linear's output is: a caller's .view() must not fail.
    assert y.is_contiguous(), y.stride()
    assert y.view(-1).shape == (whole.numel(),)

    x = whole.clone().requires_grad_()
    y = split_forward_all_gather_backward(x, tp, -1)
    close(y.detach(), mine, "split keeps this rank's columns")
    assert y.is_contiguous(), y.stride()
    y.backward(mine * (r + 1))
    want = torch.cat([whole[..., rows_of(k, i, n)] * (i + 1) for i in range(k)], dim=-1)
    close(x.grad, want, "split's backward gathers every rank's gradient")


# --- the layers against the full nn.Linear ---------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["plain", "gather", "sequence"])
@pytest.mark.parametrize("seq", SEQS)
def test_column_parallel_equals_linear(tp, seq, shape, mode):
    fin, fout = shape
    ref = nn.Linear(fin, fout).double()
    with torch.no_grad():
        ref.weight.copy_(full(fout, fin, seed=1))
        ref.bias.copy_(full(fout, seed=2))
    layer = ColumnParallelLinear.from_full(ref, tp, gather_output=mode == "gather",
                                           sequence_parallel=mode == "sequence")
    x = full(seq, BATCH, fin, seed=3).requires_grad_()
    w = full(seq, BATCH, fout, seed=4)
    y = ref(x)
    (y * w).sum().backward()

    mine = layer.ranges
    xin = (x.detach()[rows(tp, seq)] if mode == "sequence" else x.detach()).clone().requires_grad_()
    out = layer(xin, seq_len=seq) if mode == "sequence" else layer(xin)
    assert out.is_contiguous(), out.stride()  # as nn.Linear's: .view() works on it
    if mode == "gather":
        close(out.detach(), y.detach(), "gathered output")
        (out * w).sum().backward()
    else:
        close(out.detach(), cols(y.detach(), mine), "this rank's output columns")
        (out * cols(w, mine)).sum().backward()
    want_dx = x.grad[rows(tp, seq)] if mode == "sequence" else x.grad
    close(xin.grad, want_dx, "input gradient")
    close(layer.weight.grad, layer.shard("weight", ref.weight.grad), "weight gradient slice")
    close(layer.bias.grad, layer.shard("bias", ref.bias.grad), "bias gradient slice")
    assert layer.weight.shape == (sum(hi - lo for lo, hi in mine), fin)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["parallel-input", "full-input", "sequence"])
@pytest.mark.parametrize("seq", SEQS)
def test_row_parallel_equals_linear(tp, seq, shape, mode):
    fout, fin = shape  # the row layer splits its inputs: 17 and 3 of them
    ref = nn.Linear(fin, fout).double()
    with torch.no_grad():
        ref.weight.copy_(full(fout, fin, seed=5))
        ref.bias.copy_(full(fout, seed=6))
    layer = RowParallelLinear.from_full(ref, tp, input_is_parallel=mode != "full-input",
                                        sequence_parallel=mode == "sequence")
    x = full(seq, BATCH, fin, seed=7).requires_grad_()
    w = full(seq, BATCH, fout, seed=8)
    y = ref(x)
    (y * w).sum().backward()

    mine = layer.ranges
    xin = (x.detach() if mode == "full-input" else cols(x.detach(), mine)).clone().requires_grad_()
    out = layer(xin)
    if mode == "sequence":
        close(out.detach(), y.detach()[rows(tp, seq)], "this rank's output rows")
        (out * w[rows(tp, seq)]).sum().backward()
    else:
        close(out.detach(), y.detach(), "reduced output")
        (out * w).sum().backward()
    close(xin.grad, x.grad if mode == "full-input" else cols(x.grad, mine), "input gradient")
    close(layer.weight.grad, layer.shard("weight", ref.weight.grad), "weight gradient slice")
    close(layer.bias.grad, ref.bias.grad, "bias gradient (whole: added once, after the sum)")


def test_heads_split_whole_in_fused_blocks(tp):
    heads, hd, d = 5, 3, 4
    ref = nn.Linear(d, 3 * heads * hd).double()
    layer = ColumnParallelLinear.from_full(ref, tp, blocks=3, unit=hd)
    x = full(SEQ, d, seed=9)
    y = ref(x).view(SEQ, 3, heads, hd)
    got = layer(x).detach().view(SEQ, 3, -1, hd)
    lo, hi = chunk_bounds(heads, tp.size)[tp.rank]
    close(got, y[:, :, lo:hi].detach(), "this rank's whole heads of q, k and v")


@pytest.mark.parametrize("vocab", [37, 3])
@pytest.mark.parametrize("sequence", [False, True], ids=["plain", "sequence"])
@pytest.mark.parametrize("seq", SEQS)
def test_vocab_parallel_embedding_equals_embedding(tp, seq, vocab, sequence):
    ref = nn.Embedding(vocab, 6).double()
    with torch.no_grad():
        ref.weight.copy_(full(vocab, 6, seed=10))
    layer = VocabParallelEmbedding.from_full(ref, tp, sequence_parallel=sequence)
    ids = (torch.arange(seq * BATCH).view(seq, BATCH) * 5 + 2) % vocab
    w = full(seq, BATCH, 6, seed=11)
    y = ref(ids)
    (y * w).sum().backward()
    out = layer(ids)
    part = rows(tp, seq) if sequence else slice(None)
    close(out.detach(), y.detach()[part], "embedding")
    (out * w[part]).sum().backward()
    close(layer.weight.grad, layer.shard("weight", ref.weight.grad), "this rank's rows' gradient")


@pytest.mark.parametrize("sequence", [False, True], ids=["plain", "sequence"])
def test_a_second_derivative_through_the_layers(tp, sequence):
    # create_graph=True: each collective's backward must itself be differentiable,
    # else the tensor-parallel path drops out of the second derivative while another
    # path (x**3) keeps the graph alive, and the result is silently wrong.
    torch.manual_seed(5)  # the same full layers on every rank
    ref_c, ref_r = nn.Linear(6, 9).double(), nn.Linear(9, 4).double()
    col = ColumnParallelLinear.from_full(ref_c, tp, sequence_parallel=sequence)
    row = RowParallelLinear.from_full(ref_r, tp, sequence_parallel=sequence)
    x = full(SEQ, BATCH, 6, seed=6)

    def second(fn, inp):
        inp = inp.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(inp).sum() + (inp ** 3).sum(), inp, create_graph=True)
        return torch.autograd.grad((g ** 2).sum(), inp)[0]

    part = rows(tp, SEQ) if sequence else slice(None)
    want = second(lambda v: ref_r(torch.tanh(ref_c(v)))[part], x)[part]
    got = second(lambda v: row(torch.tanh(col(v, seq_len=SEQ))), x[part])
    close(got, want, "second derivative")
    logits = full(SEQ, BATCH, 37, seed=12)[..., rows(tp, 37)].clone().requires_grad_()
    target = (torch.arange(SEQ * BATCH).view(SEQ, BATCH) * 7 + 1) % 37
    with pytest.raises(RuntimeError, match="no second derivative"):  # said, not dropped
        torch.autograd.grad(vocab_parallel_cross_entropy(logits, target, tp), logits,
                            create_graph=True)


def test_an_input_that_only_one_rank_gets_wrong_is_refused_on_every_rank(tp):
    # The last rank's shard has a row too many (or its targets do not fit): every rank
    # raises before any data moves, not that one alone while the others wait for it.
    if tp.size == 1:
        pytest.skip("needs another rank to notice")
    last = tp.rank == tp.size - 1
    layer = ColumnParallelLinear(6, 9, tp, sequence_parallel=True).double()
    lo, hi = chunk_bounds(SEQ, tp.size)[tp.rank]
    with pytest.raises(ValueError, match=rf"r{tp.size - 1}: the tensor has \d+ entries along "
                                         r"dim 0, sizes=.* pass the sizes of the split"):
        layer(full(hi - lo + int(last), BATCH, 6, seed=3), seq_len=SEQ)
    logits = full(4, 37, seed=4)[:, rows(tp, 37)]
    target = torch.zeros(5 if last else 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"target shape \(5,\) does not match the logits' "
                                         r"\(4,\)"):
        vocab_parallel_cross_entropy(logits, target, tp)
    # A row layer's input cut another way than array_split (torch.chunk, say) fits on
    # some ranks only; the embedding's ids may be bad in one rank's batch only.
    bad_row = rf"r{tp.size - 1}: RowParallelLinear: the input has \d+ features"
    for sequence in (False, True):
        row = RowParallelLinear(10, 4, tp, sequence_parallel=sequence).double()
        with pytest.raises(ValueError, match=bad_row + r", this rank's rows of the weight"):
            row(full(4, BATCH, row.weight.shape[1] + int(last), seed=5))
    row = RowParallelLinear(10, 4, tp, input_is_parallel=False).double()
    with pytest.raises(ValueError, match=bad_row + r", the layer .* takes all 10"):
        row(full(4, BATCH, 10 - int(last), seed=5))
    for sequence in (False, True):
        emb = VocabParallelEmbedding(11, 6, tp, sequence_parallel=sequence)
        ids = torch.tensor([[0, 5], [10, 3]])
        ids[1, 0] += int(last)
        with pytest.raises(IndexError if last else ValueError,
                           match=rf"r{tp.size - 1}: VocabParallelEmbedding: ids span \[0, 11\]"):
            emb(ids)
    # Nothing moved: the group still works, and in step.
    x = torch.ones(3, dtype=torch.float64)
    tp.all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(tp.size), dtype=torch.float64))


def test_an_uneven_sequence_split_without_seq_len_names_seq_len(tp):
    # 7 tokens split by array_split over 2-4 ranks are uneven; without seq_len the
    # column layer takes the shards as even, and every rank is told to pass it.
    if tp.size == 1:
        pytest.skip("one rank's shard is the whole sequence")
    layer = ColumnParallelLinear(6, 9, tp, sequence_parallel=True).double()
    x = full(SEQ, BATCH, 6, seed=3)[rows(tp, SEQ)]
    with pytest.raises(ValueError, match=r"count differs.* pass forward\(x, seq_len=s\) with "
                                         "the full sequence length"):
        layer(x)
    assert layer(x, seq_len=SEQ).shape == (SEQ, BATCH, len(range(*layer.ranges[0])))


def test_a_row_layer_given_the_full_input_names_input_is_parallel(tp):
    if tp.size == 1:
        pytest.skip("one rank's features are the full input")
    layer = RowParallelLinear(12, 4, tp).double()
    with pytest.raises(ValueError, match="the input has 12 features, this rank's rows of the "
                                         "weight take .* input_is_parallel=False"):
        layer(full(3, 12, seed=1))


@pytest.mark.parametrize("bad", [-1, 37])
def test_vocab_parallel_embedding_refuses_ids_outside_the_vocabulary(tp, bad):
    # nn.Embedding raises; without the check, no rank owns the id and it comes back
    # a zero vector.
    layer = VocabParallelEmbedding(37, 6, tp)
    ids = torch.tensor([[0, 5], [bad, 36]])
    with pytest.raises(IndexError, match=r"outside \[0, 37\): pass token ids of the full"):
        layer(ids)
    assert layer(torch.zeros(0, 2, dtype=torch.long)).shape == (0, 2, 6)  # empty: nothing to check


@pytest.mark.parametrize("vocab", [37, 3])
@pytest.mark.parametrize("scale", [1.0, 1000.0], ids=["unit", "x1000"])
def test_vocab_parallel_cross_entropy_equals_cross_entropy(tp, vocab, scale):
    logits = full(SEQ, BATCH, vocab, seed=12, scale=scale).requires_grad_()
    target = (torch.arange(SEQ * BATCH).view(SEQ, BATCH) * 7 + 1) % vocab
    want = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
    want.backward()
    local = logits.detach()[..., rows(tp, vocab)].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, target, tp)
    assert torch.isfinite(got)
    close(got.detach(), want.detach(), "loss")
    got.backward()
    close(local.grad, logits.grad[..., rows(tp, vocab)], "this rank's logits' gradient")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_ignore_index_smoothing_reduction(tp, reduction, smoothing):
    vocab = 37
    logits = full(SEQ, BATCH, vocab, seed=13).requires_grad_()
    target = (torch.arange(SEQ * BATCH).view(SEQ, BATCH) * 5 + 2) % vocab
    target[1, 0] = target[4, 1] = -7  # ignored rows, not the default value
    kw = dict(ignore_index=-7, label_smoothing=smoothing, reduction=reduction)
    want = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), **kw)
    weight = full(*want.shape, seed=14) if reduction == "none" else torch.tensor(1.7)
    (want * weight).sum().backward()
    local = logits.detach()[..., rows(tp, vocab)].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, target, tp, **kw)
    close(got.detach().reshape(want.shape), want.detach(), f"{reduction} loss")
    (got.reshape(want.shape) * weight).sum().backward()
    close(local.grad, logits.grad[..., rows(tp, vocab)], "this rank's logits' gradient")
    assert torch.equal(local.grad[1, 0], torch.zeros_like(local.grad[1, 0])), "ignored row"


def test_cross_entropy_of_bfloat16_logits_is_summed_in_float32(tp):
    vocab = 37
    logits = full(SEQ, BATCH, vocab, seed=15, scale=4.0).to(torch.bfloat16)
    target = (torch.arange(SEQ * BATCH).view(SEQ, BATCH) * 3) % vocab
    want = F.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1))
    local = logits[..., rows(tp, vocab)].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, target, tp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    got.backward()
    assert local.grad.dtype == torch.bfloat16


def test_cross_entropy_buffers_live_on_the_logits_device(tp):
    # Its buffers follow the logits, not torch's default device: a default of "meta"
    # stands in, on a CPU-only machine, for CUDA logits meeting a CPU buffer (the
    # GPU case itself is in test_gpu.py).
    vocab = 11
    logits = full(5, vocab, seed=16).requires_grad_()
    target = torch.tensor([0, 3, -100, 10, 7])
    want = F.cross_entropy(logits, target, label_smoothing=0.2)
    want.backward()
    local = logits.detach()[:, rows(tp, vocab)].clone().requires_grad_()
    with torch.device("meta"):
        got = vocab_parallel_cross_entropy(local, target, tp, label_smoothing=0.2)
    assert got.device.type == "cpu"
    close(got.detach(), want.detach(), "loss")
    got.backward()
    close(local.grad, logits.grad[:, rows(tp, vocab)], "this rank's logits' gradient")


def test_cross_entropy_all_ignored_is_nan_like_torch(tp):
    local = torch.zeros(3, len(range(*rows(tp, 5).indices(5))), dtype=torch.float64)
    got = vocab_parallel_cross_entropy(local, torch.full((3,), -100), tp, vocab_size=5)
    assert torch.isnan(got) and torch.isnan(F.cross_entropy(torch.zeros(3, 5),
                                                            torch.full((3,), -100)))


def test_cross_entropy_target_outside_the_vocabulary_fails_on_every_rank(tp):
    vocab = 11
    local = torch.zeros(4, len(range(*rows(tp, vocab).indices(vocab))), dtype=torch.float64)
    target = torch.tensor([0, 3, 5, 1])
    if tp.rank == tp.size - 1:
        target[2] = vocab  # one rank's bad target: every rank must raise, none wait
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_cross_entropy(local, target, tp, vocab_size=vocab)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(local, target, tp, vocab_size=vocab, reduction="avg")


def test_default_init_is_the_full_layers_at_every_size(tp):
    for make_full, make_tp in [
        (lambda: nn.Linear(13, 17), lambda: ColumnParallelLinear(13, 17, tp)),
        (lambda: nn.Linear(17, 13), lambda: RowParallelLinear(17, 13, tp)),
        (lambda: nn.Embedding(37, 5), lambda: VocabParallelEmbedding(37, 5, tp)),
    ]:
        torch.manual_seed(123)
        ref = make_full()
        torch.manual_seed(123)
        layer = make_tp()
        for name, p in layer.named_parameters():
            assert torch.equal(p.detach(), layer.shard(name, getattr(ref, name))), name


def test_from_full_honours_dtype_and_refuses_what_it_cannot_do(tp):
    # An option that changes the layer is applied or refused, never dropped: dtype=
    # converts the slice, as nn.Linear(..., dtype=) would; options the embedding does
    # not reproduce name the fix.
    lin = nn.Linear(13, 17)
    for make in (ColumnParallelLinear, RowParallelLinear):
        layer = make.from_full(lin, tp, dtype=torch.float64, device="cpu")
        for name, p in layer.named_parameters():
            assert p.dtype == torch.float64, (make.__name__, name, p.dtype)
            assert torch.equal(p.detach(), layer.shard(name, getattr(lin, name).double())), name
    emb = VocabParallelEmbedding.from_full(nn.Embedding(11, 3), tp, dtype=torch.float64)
    assert emb.weight.dtype == torch.float64
    for option in (dict(padding_idx=2), dict(max_norm=1.0), dict(scale_grad_by_freq=True),
                   dict(sparse=True)):
        (name,) = option
        with pytest.raises(ValueError, match=f"{name} is not supported by VocabParallelEmbedding: "
                                             "build the full nn.Embedding without it"):
            VocabParallelEmbedding.from_full(nn.Embedding(11, 3, **option), tp)


def test_from_full_keeps_each_parameter_frozen_or_trainable(tp):
    # Fine-tuning freezes layers before splitting them: no slice may come back trainable.
    lin = nn.Linear(13, 17)
    lin.weight.requires_grad_(False)  # the bias stays trainable: the flag is per parameter
    for make in (ColumnParallelLinear, RowParallelLinear):
        layer = make.from_full(lin, tp)
        assert (layer.weight.requires_grad, layer.bias.requires_grad) == (False, True), make
    emb = VocabParallelEmbedding.from_full(nn.Embedding(11, 3).requires_grad_(False), tp)
    assert not emb.weight.requires_grad


@pytest.mark.parametrize("mode", ["plain", "sequence"])
def test_row_parallel_under_autocast_returns_what_linear_returns(tp, mode):
    # nn.Linear adds its float32 bias inside the autocast GEMM and returns bfloat16;
    # a float32 output here would double the activations downstream.
    ref = nn.Linear(13, 5)
    with torch.no_grad():  # the same layer on every rank
        ref.weight.copy_(full(5, 13, seed=10))
        ref.bias.copy_(full(5, seed=11))
    layer = RowParallelLinear.from_full(ref, tp, sequence_parallel=mode == "sequence")
    x = full(SEQ, BATCH, 13, seed=9).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
        got = layer(cols(x, layer.ranges))
    assert got.dtype == want.dtype == torch.bfloat16, (got.dtype, want.dtype)
    want = want[rows(tp, SEQ)] if mode == "sequence" else want
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_weight_memory_is_a_share_of_the_full_layer(tp):
    k = tp.size
    for layer, n in [(ColumnParallelLinear(64, 2049, tp), 2049 * 64),
                     (RowParallelLinear(2049, 64, tp, bias=False), 2049 * 64)]:
        mine = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        assert mine <= n // k + 64, (mine, n, k)  # one row or column of rounding at most


# --- dropout streams --------------------------------------------------------------------
def test_rng_streams_shared_alike_tensor_apart(tp):
    streams = RNGStreams(seed=5, tp_rank=tp.rank)
    torch.manual_seed(1000 + tp.rank)  # the global stream differs per rank on purpose
    before = torch.get_rng_state()
    draws = {}
    for name in ("shared", "tensor"):
        with streams.fork(name):
            draws[name] = F.dropout(torch.ones(64, dtype=torch.float64), 0.5)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore torch's generator"
    for name, mine in draws.items():
        everyone = torch.zeros(tp.size, 64, dtype=torch.float64)
        everyone[tp.rank] = mine
        tp.all_gather(everyone)
        same = all(torch.equal(everyone[0], everyone[i]) for i in range(tp.size))
        if name == "shared":
            assert same, "the shared stream must give every rank the same mask"
        elif tp.size > 1:
            assert not same, "the tensor stream must give the ranks different masks"
    with streams.fork("shared"):
        again = F.dropout(torch.ones(64, dtype=torch.float64), 0.5)
    assert not torch.equal(again, draws["shared"]), "a stream advances: the next mask is new"


# --- bad input: clear errors, on every rank, before any byte moves ------------------------
def test_bad_input_is_refused_on_every_rank(tp):
    with pytest.raises(ValueError, match="whole groups"):
        shard_ranges(10, tp.size, tp.rank, blocks=3)
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(4, 12, tp, gather_output=True, blocks=3)
    with pytest.raises(TypeError, match="nn.Linear"):
        ColumnParallelLinear.from_full(nn.Embedding(3, 4), tp)
    with pytest.raises(TypeError, match="Communicator"):
        RowParallelLinear(4, 4, comm=None)
    with pytest.raises(ValueError, match="one non-negative length per rank"):
        all_gather_forward_reduce_scatter_backward(torch.zeros(2, 3), tp, 0, [2] * (tp.size + 1))
    with pytest.raises(ValueError, match="pass the logits of this rank"):
        vocab_parallel_cross_entropy(torch.zeros(3, 40), torch.zeros(3, dtype=torch.int64), tp,
                                     vocab_size=37 * tp.size + 1000)
    # Nothing moved: the group still works, and in step.
    x = torch.ones(3, dtype=torch.float64)
    tp.all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(tp.size), dtype=torch.float64))


def test_an_algo_the_configuration_cannot_run_is_refused_at_construction(tp):
    # recursive-doubling and halving-doubling are AllReduce-only: a layer that gathers
    # or scatters would otherwise fail at its first forward (or backward).
    for algo in ("recursive-doubling", "halving-doubling"):
        for make, size, kw, calls in [
            (ColumnParallelLinear, (4, 6), dict(gather_output=True),
             "all_reduce, all_gather, and .* is not an algorithm of all_gather"),
            (ColumnParallelLinear, (4, 6), dict(sequence_parallel=True),
             "all_gather, reduce_scatter, and .* of all_gather or reduce_scatter"),
            (RowParallelLinear, (6, 4), dict(input_is_parallel=False),
             "all_gather, all_reduce, and"),
            (RowParallelLinear, (6, 4), dict(sequence_parallel=True),
             "reduce_scatter, all_gather, all_reduce, and"),
            (VocabParallelEmbedding, (10, 4), dict(sequence_parallel=True),
             r"VocabParallelEmbedding\(sequence_parallel=True\) calls reduce_scatter, "
             "all_gather"),
        ]:
            with pytest.raises(ValueError, match=rf"algo='{algo}': .*{calls}.* use one of auto, "
                                                 "ring, ring-seg, native"):
                make(*size, tp, algo=algo, **kw)
        # An AllReduce is all the plain layers call: these algorithms suit them.
        col = ColumnParallelLinear(4, 6, tp, algo=algo).double()
        row = RowParallelLinear(6, 4, tp, algo=algo).double()
        emb = VocabParallelEmbedding(10, 4, tp, algo=algo)
        x = full(3, 4, seed=7).requires_grad_()
        (row(col(x)).sum() + emb(torch.tensor([1, 9])).sum()).backward()
    with pytest.raises(ValueError, match="use one of auto, ring, ring-seg, recursive-doubling"):
        ColumnParallelLinear(4, 6, tp, algo="rign")


@pytest.mark.deadline(240)
def test_odd_five_rank_group(rank0_subprocess, world):
    """The ``world`` cases above on a 5-rank job (a nested mpiexec)."""
    if world.size >= 5:
        pytest.skip("this job already is the odd one")
    # Without hypothesis's plugin (nothing here uses it): importing it costs every one of
    # the five ranks about a second of CPU, on shared cores.
    result = rank0_subprocess(5, ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "-p", "no:hypothesispytest", "-k", "world",
                                  "tests/test_tensor_parallel.py"], timeout=220)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0, out
    assert " passed" in out and " failed" not in out, out
