"""The ONNX form of the PyTorch path's attention op, for ``torch.onnx.export(..., dynamo=True)``.

Under ``torch.export`` the CPU path of ``forgetting_attention`` is one custom op, ``foxlm::attention_from_cumsum``
(sdpa.py: its chunks are planned on the host, which no graph holds). ONNX has no such op; this translation writes it
as dense masked softmax attention with the gate's bias, in fp32 (fp64 for fp64 inputs), as the op computes::

    torch.onnx.export(model, (input_ids,), dynamo=True, custom_translation_table=onnx_translation_table())

Dense: memory grows as T^2 (the graph holds one [B, H, Tq, Tk] score tensor), as in transformers' eager attention.
ACP's threshold is not applied: the skipped tiles carry less than its tolerance of the attention mass, and the
ONNX graph computes them. Packed sequences (``cu_seqlens``, which is also how a model lays out a padded batch given
an ``attention_mask``) are masked per sequence; where the offsets are a model's padding layout (three sequences a
row of the flattened batch, checked at run time) the graph attends row by row, a [B, H, T, T] score tensor as
transformers' eager attention holds for a padded batch, else over the whole packed row.

The table also writes the two ops of a model's padding layout that ONNX lacks, for integer and bool tensors: the
stable sort (``aten.sort.stable``) and the running maximum (``aten.cummax``), each as [..., n, n] comparisons.
"""

from __future__ import annotations

import torch


def onnx_translation_table() -> dict:
    """{op overload: ONNX function} for ``torch.onnx.export``'s ``custom_translation_table`` (needs onnxscript): the
    attention op, and the stable sort and running maximum of a model's padding layout (integer and bool tensors)."""
    try:
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ImportError("ONNX export needs onnxscript and onnx: pip install 'foxlm[onnx]'") from e
    from . import sdpa  # noqa: F401  (registers the op)

    return {torch.ops.foxlm.attention_from_cumsum.default: _attention_from_cumsum,
            torch.ops.aten.sort.stable: _stable_sort, torch.ops.aten.cummax.default: _cummax}


def _pairwise(x, name: str, dim: int):
    """x [..., n (at dim), ...] as int64, for comparisons of every pair along dim: (x_i [n at dim, 1 at dim + 1],
    x_j [1 at dim, n at dim + 1], i and j in the same layout, the normalised dim)."""
    from onnxscript import INT64
    from onnxscript import opset18 as op

    dtype = x.dtype
    # compared as int64, which uint64 above 2^63 would wrap
    if dtype.name == "UINT64" or not (dtype.is_integer() or dtype.name == "BOOL"):
        raise NotImplementedError(f"{name}: only integer (but uint64) and bool tensors have an ONNX form here, "
                                  f"got {dtype.name}")
    rank = len(x.shape)
    dim = dim % rank
    x = op.Cast(x, to=INT64.dtype)
    n = op.Squeeze(op.Slice(op.Shape(x), op.Constant(value_ints=[dim]), op.Constant(value_ints=[dim + 1])),
                   op.Constant(value_ints=[0]))
    idx = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))

    def along(t, axis):  # [n] -> n at axis, 1 elsewhere (rank + 1 dims)
        shape = [1] * (rank + 1)
        shape[axis] = -1
        return op.Reshape(t, op.Constant(value_ints=shape))

    return (op.Unsqueeze(x, op.Constant(value_ints=[dim + 1])), op.Unsqueeze(x, op.Constant(value_ints=[dim])),
            along(idx, dim), along(idx, dim + 1), dim)


def _stable_sort(x, stable=None, dim: int = -1, descending: bool = False):
    """aten.sort.stable: (values, indices int64) along dim, ties in their order (stable, whatever ``stable``). Each
    element's rank is the number of elements before it in the sorted order, counted over all pairs."""
    from onnxscript import INT64
    from onnxscript import opset18 as op

    xi, xj, i, j, dim = _pairwise(x, "aten.sort.stable", dim)
    ahead = op.Greater(xj, xi) if descending else op.Less(xj, xi)
    ahead = op.Or(ahead, op.And(op.Equal(xj, xi), op.Less(j, i)))
    rank = op.ReduceSum(op.Cast(ahead, to=INT64.dtype), op.Constant(value_ints=[dim + 1]), keepdims=0)
    positions = op.Expand(op.Squeeze(i, op.Constant(value_ints=[dim + 1])), op.Shape(rank))
    indices = op.ScatterElements(positions, rank, positions, axis=dim)  # the element of rank r goes to slot r
    return op.GatherElements(x, indices, axis=dim), indices


def _cummax(x, dim: int):
    """aten.cummax: (values, indices int64) along dim, the index of the last occurrence of the maximum so far."""
    from onnxscript import opset18 as op

    xi, xj, i, j, dim = _pairwise(x, "aten.cummax", dim)
    seen = op.LessOrEqual(j, i)
    first = op.Slice(xj, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[dim + 1]))
    values = op.ReduceMax(op.Where(seen, xj, first), op.Constant(value_ints=[dim + 1]), keepdims=1)  # x_0 is seen
    at = op.And(seen, op.Equal(xj, values))
    indices = op.ReduceMax(op.Where(at, j, op.Constant(value_int=-1)), op.Constant(value_ints=[dim + 1]), keepdims=0)
    values = op.CastLike(op.Squeeze(values, op.Constant(value_ints=[dim + 1])), x)
    return values, indices


def _rows_of_segments(cu_seqlens, total):
    """The flattened tokens of packed input cut into rows that no sequence crosses: (rows R, row length L, each
    token's sequence start [total] int64, global). R is the model's batch where ``cu_seqlens`` is its padding layout
    (``cu_seqlens_of_runs``: three sequences a row, R = N / 3, every row's start an offset), checked on the offsets
    at run time; else 1 (the whole row). Attention within each row then needs [R, H, L, L] scores, not
    [1, H, R*L, R*L]."""
    from onnxscript import INT64
    from onnxscript import opset18 as op

    def ints(*values):
        return op.Constant(value_ints=list(values))

    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    offsets = op.Cast(op.Slice(cu_seqlens, ints(0), ints(-1)), to=INT64.dtype)  # [N], sorted, 0 first
    # a token's sequence is the last offset <= it: count the offsets at or before every position (a scatter and a
    # running sum, O(total + N), where comparing every token with every offset is O(total * N))
    counts = op.ScatterElements(op.Expand(zero, op.Reshape(op.Add(total, one), ints(1))), offsets,
                                op.Expand(one, op.Shape(offsets)), axis=0, reduction="add")
    seen = op.CumSum(op.Slice(counts, ints(0), op.Reshape(total, ints(1))), zero)
    start = op.Gather(offsets, op.Sub(seen, one))  # [total]
    rows = op.Max(op.Div(op.Squeeze(op.Shape(offsets), ints(0)), op.Constant(value_int=3)), one)
    length = op.Max(op.Div(total, rows), one)
    bounds = op.Range(zero, total, length)  # where the rows would start
    crossed = op.ReduceSum(op.Cast(op.Not(op.Equal(op.Gather(start, bounds), bounds)), to=INT64.dtype),
                           keepdims=0)
    fits = op.And(op.Equal(op.Mul(rows, length), total), op.Equal(crossed, zero))
    rows = op.Where(fits, rows, one)
    return rows, op.Div(total, rows), start


def _attention_from_cumsum(q, k, v, c_q, c_k, threshold=None, cu_seqlens=None, scale: float = 1.0,
                           q_offset: int = 0, window: int | None = None, channels: bool = False):
    """foxlm::attention_from_cumsum in ONNX ops: (o [B, Tq, Hq, Dv or the channel width], lse [B, Hq, Tq], row
    starts). q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv], c_q: [B, Tq, Hq], c_k: [B, Tk, Hq]."""
    from onnxscript import DOUBLE, FLOAT, INT64
    from onnxscript import opset18 as op

    Hq, D = q.shape[2], q.shape[3]
    Hk, Dv = k.shape[2], v.shape[3]
    if not all(isinstance(n, int) for n in (Hq, D, Hk, Dv)):
        raise NotImplementedError("foxlm::attention_from_cumsum: heads and head dims must be static to export")

    # the op computes in q's dtype promoted to fp32 (fp64 stays fp64)
    dtype = DOUBLE.dtype if q.dtype == DOUBLE.dtype else FLOAT.dtype

    def ints(*values):
        return op.Constant(value_ints=list(values))

    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    tq = op.Squeeze(op.Slice(op.Shape(q), ints(1), ints(2)), ints(0))
    tk = op.Squeeze(op.Slice(op.Shape(k), ints(1), ints(2)), ints(0))
    if cu_seqlens is not None:  # B == 1, Tq == Tk, q_offset 0: attend within rows no sequence crosses
        rows, tq, start = _rows_of_segments(cu_seqlens, tq)
        tk = tq
        grid = op.Concat(op.Reshape(rows, ints(1)), op.Reshape(tq, ints(1)), axis=0)
        q, k, v, c_q, c_k = (op.Reshape(x, op.Concat(grid, ints(*dims), axis=0)) for x, dims in
                             ((q, (Hq, D)), (k, (Hk, D)), (v, (Hk, Dv)), (c_q, (Hq,)), (c_k, (Hq,))))
        row_first = op.Unsqueeze(op.Mul(op.Range(zero, rows, one), tq), ints(1))  # [R, 1] each row's first token
        start = op.Sub(op.Reshape(start, grid), row_first)  # [R, L] the sequence start within the row

    def heads_first(x, repeat: bool):  # [B, T, H, d] -> [B, H, T, d] in dtype; repeat: a key head for each of its group
        x = op.Transpose(op.Cast(x, to=dtype), perm=[0, 2, 1, 3])
        if repeat and Hq != Hk:  # [B, Hk, T, d] -> [B, Hk, G, T, d] -> [B, Hq, T, d]
            shape = op.Shape(x)
            batch, rest = op.Slice(shape, ints(0), ints(1)), op.Slice(shape, ints(2), ints(4))
            x = op.Expand(op.Unsqueeze(x, ints(2)), op.Concat(batch, ints(Hk, Hq // Hk), rest, axis=0))
            x = op.Reshape(x, op.Concat(batch, ints(Hq), rest, axis=0))
        return x

    qh, kh, vh = heads_first(q, False), heads_first(k, True), heads_first(v, True)
    s = op.Mul(op.MatMul(qh, op.Transpose(kh, perm=[0, 1, 3, 2])), op.Cast(op.Constant(value_float=float(scale)),
                                                                          to=dtype))
    # the gate's bias c_i - c_j, taken in c's own precision (fp64 from the layers) before the cast: |c| grows with T
    bias = op.Sub(op.Unsqueeze(op.Transpose(c_q, perm=[0, 2, 1]), ints(3)),
                  op.Unsqueeze(op.Transpose(c_k, perm=[0, 2, 1]), ints(2)))
    s = op.Add(s, op.Cast(bias, to=dtype))
    pos = op.Add(op.Range(zero, tq, one), op.Constant(value_int=int(q_offset)))  # [Tq] key position of each query
    keys = op.Range(zero, tk, one)
    visible = op.LessOrEqual(op.Unsqueeze(keys, ints(0)), op.Unsqueeze(pos, ints(1)))  # [Tq, Tk]
    first = zero  # a row's first visible key: a scalar, [Tq], or [R, Tq] with cu_seqlens
    if window is not None:
        first = op.Max(op.Sub(pos, op.Constant(value_int=int(window) - 1)), zero)
    if cu_seqlens is not None:
        first = op.Max(first, start)
    if window is not None or cu_seqlens is not None:
        # [Tq, 1], or [R, 1, Tq, 1] against the scores [R, Hq, Tq, Tk]
        axes = ints(1, 3) if cu_seqlens is not None else ints(1)
        visible = op.And(visible, op.GreaterOrEqual(op.Unsqueeze(keys, ints(0)), op.Unsqueeze(first, axes)))
    s = op.Where(visible, s, op.Cast(op.Constant(value_float=float("-inf")), to=dtype))
    m = op.ReduceMax(s, ints(-1), keepdims=1)
    p = op.Exp(op.Sub(s, m))
    total = op.ReduceSum(p, ints(-1), keepdims=1)
    lse = op.Squeeze(op.Add(m, op.Log(total)), ints(3))
    o = op.Transpose(op.Div(op.MatMul(p, vh), total), perm=[0, 2, 1, 3])  # [B, Tq, Hq, Dv]
    if channels:  # the op's widened output o' (its caller reads the first Dv channels)
        o = op.Pad(o, ints(0, 0, 0, 0, 0, 0, 0, max(D, Dv) + 2 - Dv))
    if cu_seqlens is not None:  # the rows back to the one packed row: o [1, R*L, Hq, .], lse [1, Hq, R*L]
        o = op.Reshape(o, ints(1, -1, Hq, max(D, Dv) + 2 if channels else Dv))
        lse = op.Reshape(op.Transpose(lse, perm=[1, 0, 2]), ints(1, Hq, -1))
        first = op.Reshape(op.Add(first, row_first), ints(1, 1, -1))  # the packed row's key positions
    if threshold is None and window is None and cu_seqlens is None:
        starts = op.Constant(value_ints=[])
    else:  # [B, Hq, Tq], as the op's fake gives it
        starts = op.Expand(op.Cast(first, to=INT64.dtype), op.Shape(lse))  # first: [Tq], or 0 for every row
    return o, lse, starts
