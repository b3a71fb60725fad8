"""q, k, v from the fused QKV projection (:mod:`difflm.model.qkv`): the one function both kernel sets run equals the
step-by-step composition (head split, QK-norm module, rotary embedding), in values and gradients; on a GPU the
compiled kernel equals the eager one."""
from __future__ import annotations

import pytest
import torch
from conftest import report
from triton_interpreter import interpreted_json

from difflm.model.layers import RMSNorm
from difflm.model.qkv import qkv_heads, split_heads
from difflm.model.rope import apply_rope, rope_angles, rope_tables


def _inputs(layout, heads, kv_heads, d=16, b=2, s=12, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (b, s) if layout == "bshd" else (s, b)
    qkv = torch.randn(*lead, (heads + 2 * kv_heads) * d, generator=g).to(device=device, dtype=dtype)
    norms = []
    for _ in range(2):
        n = RMSNorm(d, eps=1e-5).to(device)
        with torch.no_grad():
            n.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
        norms.append(n)
    positions = torch.arange(3, 3 + s, device=device)
    return qkv.requires_grad_(True), norms, rope_tables(rope_angles(positions, d, 10000.0), layout)


def _stepwise(qkv, tables, heads, kv_heads, d, norms):
    """The composition qkv_heads replaces: per-group rows, norm modules, RoPE one tensor at a time."""
    lead = qkv.shape[:2]
    group = heads // kv_heads
    rows = qkv.view(*lead, kv_heads, group + 2, d)
    q = rows[..., :group, :].reshape(*lead, heads, d)
    k, v = rows[..., group, :], rows[..., group + 1, :]
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return apply_rope(q, *tables), apply_rope(k, *tables), v


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_heads_equals_the_stepwise_composition(layout, heads, kv_heads, qk_norm):
    d = 16
    qkv, norms, tables = _inputs(layout, heads, kv_heads, d)
    norms = norms if qk_norm else None
    got = qkv_heads(qkv, tables, heads, kv_heads, d, *(norms or (None, None)))
    assert [t.shape[2:] for t in got] == [(heads, d), (kv_heads, d), (kv_heads, d)]
    assert all(t.is_contiguous() for t in got)
    want = _stepwise(qkv, tables, heads, kv_heads, d, norms)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # gradients, to the projection and to the norm scales
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=g) for t in got]
    params = [qkv] + ([n.weight for n in norms] if norms else [])
    grads = torch.autograd.grad(sum((t * w).sum() for t, w in zip(got, weights)), params)
    ref = torch.autograd.grad(sum((t * w).sum() for t, w in zip(want, weights)), params)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_split_heads_reads_megatron_groups():
    """Rows per KV group: its H / H_kv query heads, then its key head, then its value head."""
    heads, kv_heads, d = 4, 2, 3
    qkv = torch.arange((heads + 2 * kv_heads) * d, dtype=torch.float32).view(1, 1, -1)
    q, k, v = split_heads(qkv, heads, kv_heads, d)
    assert q[0, 0, :, 0].tolist() == [0, 3, 12, 15]  # group 0: heads 0, 1; group 1: heads 2, 3
    assert k[0, 0, :, 0].tolist() == [6, 18] and v[0, 0, :, 0].tolist() == [9, 21]


def _triton_against_eager(device, dtype, layout, heads, kv_heads, qk_norm, d, b, s):
    """Largest |difference| of q, k, v and relative L2 differences of the gradients (QKV output, norm scales) of the
    Triton path against the eager composition, on the same inputs."""
    from difflm.model.qkv import _qkv_heads, qkv_heads_triton

    qkv, norms, (cos, sin) = _inputs(layout, heads, kv_heads, d, b=b, s=s, dtype=dtype, device=device)
    weights = (norms[0].weight, norms[1].weight) if qk_norm else (None, None)
    got = qkv_heads_triton(qkv, cos, sin, *weights, 1e-5, heads, kv_heads, d)
    want = _qkv_heads(qkv, cos, sin, *weights, 1e-5, heads, kv_heads, d)
    assert [t.shape for t in got] == [t.shape for t in want] and all(t.is_contiguous() for t in got)
    assert all(t.dtype == dtype for t in got)
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(t.shape, generator=g).to(device) for t in got]
    params = [qkv] + ([*weights] if qk_norm else [])
    grads = torch.autograd.grad(sum((t.float() * x).sum() for t, x in zip(got, w)), params)
    ref = torch.autograd.grad(sum((t.float() * x).sum() for t, x in zip(want, w)), params)
    values = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    return values, [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref)]


def _in_place_against_copies(device, dtype, layout, heads, kv_heads, qk_norm, d, b, s):
    """What :mod:`difflm.kernels.qkv_flash` asks of the Triton kernels, against their dense path on the same inputs:
    the forward without the value copy (v a view of ``qkv``), and the backward reading the incoming gradients from
    the QKV gradient's own slots (dq there only without GQA) and transforming them in place. Returns (largest
    |difference| over q, k, d qkv and the norm scales' gradients, v is a view of qkv's value slots)."""
    from difflm.kernels import qkv_triton
    from difflm.model.qkv import head_slots

    qkv, norms, (cos, sin) = _inputs(layout, heads, kv_heads, d, b=b, s=s, dtype=dtype, device=device)
    qkv = qkv.detach()
    weights = (norms[0].weight.detach(), norms[1].weight.detach()) if qk_norm else (None, None)
    args = (cos, sin, *weights, 1e-5, heads, kv_heads, d)
    dense = qkv_triton.forward(qkv, *args)
    q, k, v = qkv_triton.forward(qkv, *args, dense_v=False)
    v_is_view = v.data_ptr() == head_slots(qkv, heads, kv_heads, d)[2].data_ptr() and torch.equal(v, dense[2])
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(t.shape, generator=g).to(device=device, dtype=dtype) for t in dense]
    want = qkv_triton.backward(*grads, qkv, *args)
    dqkv = torch.full_like(qkv, float("nan"))  # every slot must be written: NaN would show through
    slots = head_slots(dqkv, heads, kv_heads, d)
    incoming = []
    for slot, grad in zip(slots, grads):
        if slot is None:  # GQA: the query gradient stays a dense tensor of its own
            incoming.append(grad)
        else:
            slot.copy_(grad)
            incoming.append(slot)
    got = qkv_triton.backward(*incoming, qkv, *args, dqkv=dqkv)
    assert got[0] is dqkv
    pairs = [(q, dense[0]), (k, dense[1]), *((a, b) for a, b in zip(got, want) if b is not None)]
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs), v_is_view


_INTERPRETED = """
import json, torch
from test_qkv import _in_place_against_copies, _triton_against_eager
from difflm.kernels import qkv_triton
# backward programs of two tiles: the interpreter runs every tile of a program, masked or not, so the committed
# count (16) would spend most of its time on empty tiles of these few rows; the CUDA tests run the committed one
qkv_triton.BWD_TILES = 2
out = []
for layout in ("bshd", "sbhd"):
    for heads, kv_heads in ((4, 4), (4, 2), (6, 1)):
        for qk_norm in (True, False):
            for d in (16, 24):  # 24: a half of 12 lanes in a block of 16 (masked)
                out.append([layout, heads, kv_heads, qk_norm, d,
                            *_triton_against_eager("cpu", torch.float32, layout, heads, kv_heads, qk_norm, d, 3, 13),
                            *(_in_place_against_copies("cpu", torch.float32, layout, heads, kv_heads, qk_norm, d, 3, 13)
                              if layout == "bshd" else (None, None))])  # qkv_flash runs batch-first only
# rows for more than two backward programs, the last one partial: the norm scales' partial sums across programs
span = qkv_triton.BWD_BLOCK_T * qkv_triton.BWD_TILES
out.append([span, *_triton_against_eager("cpu", torch.float32, "bshd", 4, 2, True, 16, 2, span + 11),
            *_in_place_against_copies("cpu", torch.float32, "bshd", 4, 2, True, 16, 2, span + 11)])
from difflm.model.qkv import qkv_heads_triton
empty = torch.zeros(2, 0, 6 * 16, requires_grad=True)
scales = [torch.nn.Parameter(torch.ones(16)) for _ in range(2)]
q, k, v = qkv_heads_triton(empty, torch.ones(0, 1, 16), torch.zeros(0, 1, 16), *scales, 1e-6, 2, 2, 16)
(q.sum() + k.sum() + v.sum()).backward()
out.append([list(q.shape), list(empty.grad.shape), scales[0].grad.abs().sum().item()])
print(json.dumps(out))
"""


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_triton_qkv_kernels_match_eager_in_the_interpreter():
    """The Triton kernels, run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is
    imported, so in a process of its own), against the eager composition in float32: both layouts, MHA and GQA,
    with and without QK-norm, a head size whose half is not a power of two, 39 rows (partial tiles), rows for four
    backward programs (the norm scales' gradients summed across programs), and no rows.
    Without QK-norm the values and gradients are bitwise equal; with it, they differ by the order of the norm's sum.
    The path of :mod:`difflm.kernels.qkv_flash` (v a view, gradients transformed in their slots; batch-first, as it
    runs) is bitwise the dense one."""
    pytest.importorskip("triton")
    rows = interpreted_json(_INTERPRETED)
    assert rows.pop() == [[2, 0, 2, 16], [2, 0, 96], 0.0]  # no tokens: empty outputs, zero scale gradients
    span, values, grads, in_place, v_is_view = rows.pop()
    assert span >= 8 and values < 2e-6 and max(grads) < 1e-6 and len(grads) == 3, (span, values, grads)
    assert in_place == 0.0 and v_is_view
    assert len(rows) == 24
    for layout, heads, kv_heads, qk_norm, d, values, grads, in_place, v_is_view in rows:
        case = (layout, heads, kv_heads, qk_norm, d)
        assert layout == "sbhd" or (in_place == 0.0 and v_is_view), (case, in_place, v_is_view)
        if qk_norm:
            assert values < 2e-6 and max(grads) < 1e-6 and len(grads) == 3, (case, values, grads)
        else:
            assert values == 0.0 and grads == [0.0], (case, values, grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA here")
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (8, 2)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_triton_qkv_kernels_match_eager_on_cuda(heads, kv_heads, qk_norm):
    """BF16 at the models' head size 128, 1,000 rows (a partial last tile): without QK-norm q, k, v are bitwise the
    eager ones (the same float32 operations, contraction off, rounded to nearest); with it, the norm's sum order may
    move a value by one BF16 step. The gradients agree to BF16 precision."""
    values, grads = _triton_against_eager("cuda", torch.bfloat16, "bshd", heads, kv_heads, qk_norm, 128, 2, 500)
    report("qkv_triton_vs_eager", heads=heads, kv_heads=kv_heads, qk_norm=qk_norm, values=values, grads=grads)
    if qk_norm:
        assert values <= 3.2e-2 and max(grads) < 1e-2, (values, grads)
    else:
        assert values == 0.0 and max(grads) < 1e-2, (values, grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA here")
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (8, 2)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_in_place_kernels_match_the_dense_path_on_cuda(heads, kv_heads, qk_norm):
    """The forward without the value copy and the backward transforming gradients in their slots, compiled for the
    GPU (BF16, head size 128, 1,000 rows): bitwise the dense kernels, v a view of the QKV output."""
    diff, v_is_view = _in_place_against_copies("cuda", torch.bfloat16, "bshd", heads, kv_heads, qk_norm, 128, 2, 500)
    assert diff == 0.0 and v_is_view, (diff, v_is_view)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention 4 runs on CUDA")
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (8, 2)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_qkv_flash_equals_qkv_heads_then_flash_attention(heads, kv_heads, qk_norm, causal, monkeypatch):
    """:func:`difflm.kernels.qkv_flash.qkv_flash_attention` (v read in place, FA4's gradients written into the QKV
    gradient's slots) against ``qkv_heads`` then ``attend(backend="flash")`` on the same BF16 inputs (head size 128,
    2 x 700 tokens), both on FA4's own forward tiles: the same kernels on the same values, so the outputs are bitwise
    equal, and so are the key and value slots of the QKV gradient without GQA (FA4 computes dK / dV of a head in one
    program); the query slots and the norm scales' gradients move with FA4's dQ, which accumulates with atomics in a
    run-dependent order."""
    from difflm.kernels import qkv_flash
    from difflm.model.attention import attend
    from difflm.model.qkv import head_slots
    from difflm.kernels.qkv_flash import fa4_interface, qkv_flash_attention

    if fa4_interface() is None:
        pytest.skip("needs FlashAttention 4 (flash_attn.cute)")
    monkeypatch.setattr(qkv_flash, "forward_tiles", lambda q, causal: {})  # attend's FA4 call takes FA4's table
    d = 128
    qkv, norms, tables = _inputs("bshd", heads, kv_heads, d, b=2, s=700, dtype=torch.bfloat16, device="cuda")
    weights = (norms[0].weight, norms[1].weight) if qk_norm else (None, None)
    got = qkv_flash_attention(qkv, tables, heads, kv_heads, d, *(norms if qk_norm else (None, None)), causal)
    q, k, v = qkv_heads(qkv, tables, heads, kv_heads, d, *(norms if qk_norm else (None, None)))
    want = attend(q, k, v, causal=causal, backend="flash", layout="bshd")
    assert got.shape == want.shape == (2, 700, heads, d) and got.dtype == torch.bfloat16 and got.is_contiguous()
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    params = [qkv] + ([*weights] if qk_norm else [])
    grads = torch.autograd.grad(got, params, dout)
    ref = torch.autograd.grad(want, params, dout)
    values = (got.float() - want.float()).abs().max().item()
    rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref)]
    report("qkv_flash_vs_two_calls", heads=heads, kv_heads=kv_heads, qk_norm=qk_norm, causal=causal, values=values,
           grads=rel)
    assert values == 0.0, values
    assert max(rel) < 1e-4, rel
    if heads == kv_heads:
        _, k_got, v_got = head_slots(grads[0], heads, kv_heads, d)
        _, k_ref, v_ref = head_slots(ref[0], heads, kv_heads, d)
        assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention 4 runs on CUDA")
def test_qkv_flash_at_the_loss_rows_gives_the_dense_calls_gradient_row_by_row():
    """With ``rows`` the QKV + FA4 function runs the queries of the loss rows only (FA4's variable-length call). Its
    output at the rows and its gradient in ``qkv`` at every loss row equal the dense call's with the other rows'
    output gradients zero (BF16, 2 x 1,000 tokens, 301 rows padded to 320 with copies of the last): in particular the
    last loss row, whose padding copies have zero query gradients that are added into its slot, not copied over it."""
    from difflm.model.loss_rows import loss_rows
    from difflm.kernels.qkv_flash import fa4_interface, qkv_flash_attention

    if fa4_interface() is None:
        pytest.skip("needs FlashAttention 4 (flash_attn.cute)")
    heads, d, b, s = 16, 128, 2, 1000
    qkv, norms, tables = _inputs("bshd", heads, heads, d, b=b, s=s, dtype=torch.bfloat16, device="cuda")
    index = torch.sort(torch.randperm(b * s, generator=torch.Generator().manual_seed(5))[:301]).values.cuda()
    picked = loss_rows(index, b, s)
    assert picked.count == 301 and picked.index.numel() == 320
    out_rows = qkv_flash_attention(qkv, tables, heads, heads, d, *norms, False, rows=picked)
    dout_rows = torch.randn(out_rows.shape, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    dout_rows[picked.count:] = 0  # the padding's outputs feed nothing in the model
    (got,) = torch.autograd.grad(out_rows, qkv, dout_rows)
    out = qkv_flash_attention(qkv, tables, heads, heads, d, *norms, False)
    dout = torch.zeros_like(out)
    dout.flatten(0, 1)[index] = dout_rows[:picked.count]
    (want,) = torch.autograd.grad(out, qkv, dout)
    values = ((out_rows[:picked.count].float() - out.flatten(0, 1)[index].float()).norm() /
              out.flatten(0, 1)[index].float().norm()).item()
    got_rows, want_rows = got.flatten(0, 1)[index].float(), want.flatten(0, 1)[index].float()
    per_row = ((got_rows - want_rows).norm(dim=-1) / want_rows.norm(dim=-1))
    whole = ((got.float() - want.float()).norm() / want.float().norm()).item()
    report("qkv_flash_rows_vs_dense", values=values, worst_row=per_row.max().item(), last_row=per_row[-1].item(),
           whole=whole)
    assert values < 4e-3, values
    assert per_row[-1] < 2e-2 and per_row.max() < 2e-2, per_row.topk(3)
    assert whole < 1e-2, whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention 4 runs on CUDA")
@pytest.mark.parametrize("rows", [False, True])
def test_hopper_forward_tiles_agree_with_fa4s_own(rows, monkeypatch):
    """On a Hopper GPU the QKV + FA4 function runs FA4's forward on 192 x 128 tiles with P.V from shared memory
    (:data:`difflm.kernels.qkv_flash.SM90_FORWARD_TILES`) for bidirectional heads of 128, and FA4's own table
    otherwise (causal, head size 64). Values and gradients equal those on FA4's own tiles up to BF16 rounding
    (2 x 1,000 tokens, 16 heads; with ``rows``, 300 query rows through the varlen call)."""
    from difflm.kernels import qkv_flash
    from difflm.model.loss_rows import loss_rows
    from difflm.kernels.qkv_flash import fa4_interface, forward_tiles, qkv_flash_attention

    if fa4_interface() is None:
        pytest.skip("needs FlashAttention 4 (flash_attn.cute)")
    q = torch.empty(1, 1, 16, 128, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert forward_tiles(q, causal=False) == ({"tile_mn": (192, 128), "mma_pv_is_rs": False} if hopper else {})
    assert forward_tiles(q, causal=True) == {} and forward_tiles(q[..., :64], causal=False) == {}
    if not hopper:
        pytest.skip("the tile override is for Hopper (SM90)")
    heads, d, b, s = 16, 128, 2, 1000
    qkv, norms, tables = _inputs("bshd", heads, heads, d, b=b, s=s, dtype=torch.bfloat16, device="cuda")
    picked = None
    if rows:
        index = torch.sort(torch.randperm(b * s, generator=torch.Generator().manual_seed(4))[:300]).values.cuda()
        picked = loss_rows(index, b, s)
    results, seen, real = [], [], fa4_interface()._flash_attn_fwd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("tile_mn"))
        return real(*args, **kwargs)

    spy.compile_cache = real.compile_cache  # FA4 reaches its kernel cache through the function's module name
    monkeypatch.setattr(fa4_interface(), "_flash_attn_fwd", spy)
    for tiles in (True, False, False):  # the second run on FA4's own tiles measures the backward's own noise
        if not tiles:
            monkeypatch.setattr(qkv_flash, "forward_tiles", lambda q, causal: {})
        out = qkv_flash_attention(qkv, tables, heads, heads, d, *norms, False, rows=picked)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
        if picked is not None:  # the rows repeated up to a multiple of 32 feed nothing in the model (loss_rows)
            dout[picked.count:] = 0
        results.append((out.float(), [g.float() for g in torch.autograd.grad(out, [qkv, *(n.weight for n in norms)],
                                                                             dout)]))
    (out, grads), (ref, ref_grads), (_, again) = results
    values = ((out - ref).norm() / ref.norm()).item()
    rel = [((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads)]
    noise = [((g - r).norm() / r.norm()).item() for g, r in zip(again, ref_grads)]
    report("sm90_forward_tiles", rows=rows, values=values, grads=rel, grads_same_tiles=noise)
    assert seen == [(192, 128), None, None]  # FA4 was handed the tile, then its own table
    assert values < 4e-3, values  # BF16 rounding of another tiling at most
    # FA4's backward adds dQ up with atomics in no fixed order, so two runs on the same tiles differ too (the norm
    # scales' gradients, sums over the rows that cancel, by ~1 % with 300 loss rows): another tiling may differ by
    # that noise on top of 1 %; a wrong forward differs by O(1)
    assert all(r < 1e-2 + 3 * n for r, n in zip(rel, noise)), (rel, noise)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention 4 runs on CUDA")
@pytest.mark.parametrize("backend,kv_heads", [("torch", 4), ("te", 4), ("te", 2)])
def test_models_with_flash_attention_take_the_fused_path(backend, kv_heads, monkeypatch):
    """``model=tiny`` with ``model.attention_backend=flash`` (FA4), built as the trainer builds it: every attention layer
    goes through :func:`difflm.kernels.qkv_flash.qkv_flash_attention` (once per layer and forward), its logits are
    bitwise those of the two-call path (the Triton QKV kernels, then FA4 on dense q / k / v) on the same weights, and
    its gradients agree within FA4's dQ rounding; ``model.fused_qkv=false`` never takes it."""
    from conftest import compose_run

    from difflm.model import build_model, transformer
    from difflm.kernels.qkv_flash import fa4_interface

    if fa4_interface() is None:
        pytest.skip("needs FlashAttention 4 (flash_attn.cute)")
    if backend == "te":
        pytest.importorskip("transformer_engine.pytorch")
    cfg = compose_run([f"model.backend={backend}", "model.attention_backend=flash", "precision=bf16",
                       f"model.num_kv_heads={kv_heads}"]).model
    cfg.vocab_size, cfg.head_dim = 256, cfg.hidden_size // cfg.num_heads
    calls, real = [], transformer.qkv_flash_attention
    monkeypatch.setattr(transformer, "qkv_flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 256, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    model = build_model(cfg, causal=False, device=torch.device("cuda"), seed=0)
    logits, grads = [], []
    for one_function in (True, False):
        if not one_function:
            monkeypatch.setattr(transformer, "fused_qkv_flash_applies", lambda *a, **k: False)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids).float()
        torch.nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
        logits.append(out.detach())
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
        assert len(calls) == cfg.num_layers  # the two-call forward added none
    assert torch.equal(logits[0], logits[1])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == sum(p.requires_grad for p in model.parameters())
    for name, ref in grads[1].items():
        assert ((grads[0][name] - ref).norm() / ref.norm()).item() < 1e-2, name
    monkeypatch.undo()
    cfg.fused_qkv = False
    calls.clear()
    monkeypatch.setattr(transformer, "qkv_flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        build_model(cfg, causal=False, device=torch.device("cuda"), seed=0)(ids)
    assert calls == []
