"""Greedy argmax (``fastdecode.argmax``): the same column as ``torch.argmax(x, dim=-1)`` on fresh random rows,
ties, NaN, -inf, odd and large widths, strided and N-D inputs, every float dtype; poisoned outputs; bad input."""

import pytest
import torch

import fastdecode as fd
from fastdecode.ops.argmax import MAX_CHUNKS, argmax_config
from helpers import strided_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned(shape):
    return torch.full(shape, -7, dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("V", [1, 7, 2048, 2049, 49152, 128256])
@pytest.mark.parametrize("B", [1, 3])
def test_random_rows(B, V):
    x = torch.randn(B, V, device=DEV)
    out = _poisoned((B,))
    y = fd.argmax(x, out=out, backend="triton")
    assert y is out
    torch.testing.assert_close(y, fd.argmax_ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_strided_and_nd(dtype):
    x = strided_rows(5, 5000, dtype, DEV)
    assert not x.is_contiguous()
    torch.testing.assert_close(fd.argmax(x, backend="triton"), torch.argmax(x, dim=-1), rtol=0, atol=0)
    x3 = torch.randn(2, 3, 3001, device=DEV).to(dtype)
    y3 = fd.argmax(x3, backend="triton")
    assert y3.shape == (2, 3) and y3.dtype == torch.int64
    torch.testing.assert_close(y3, torch.argmax(x3, dim=-1), rtol=0, atol=0)
    x1 = torch.randn(777, device=DEV).to(dtype)  # 1-D: a 0-D result
    y1 = fd.argmax(x1, backend="triton")
    assert y1.shape == () and int(y1) == int(torch.argmax(x1))


def test_ties_take_the_first_column_within_and_across_chunks():
    V = 3 * 2048 + 5
    x = torch.zeros(4, V, device=DEV)
    x[0, [9, 2048 + 1, 3 * 2048 + 4]] = 2.0  # three chunks hold the maximum: the first wins
    x[1, [3000, 2500]] = 1.0  # two in one chunk
    x[2] = -1.0  # every column equal
    x[3, -1] = 1.0  # the last column, in a short last chunk
    torch.testing.assert_close(fd.argmax(x, backend="triton"), torch.tensor([9, 2500, 0, V - 1], device=DEV),
                               rtol=0, atol=0)


def test_nan_and_inf_follow_torch():
    V = 5000
    x = torch.randn(6, V, device=DEV)
    x[0, 4000] = float("nan")  # a NaN beats everything
    x[1, [10, 4500]] = float("inf")
    x[1, 4800] = float("nan")  # ... an inf too
    x[2, [3000, 100]] = float("nan")  # the first NaN (an earlier chunk's)
    x[3] = float("-inf")  # all -inf: column 0
    x[4, 4999] = float("inf")
    x[5] = float("nan")
    want = torch.tensor([4000, 4800, 100, 0, 4999, 0], device=DEV)
    got = fd.argmax(x, backend="triton")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.argmax(x, dim=-1), want, rtol=0, atol=0)  # the rule is torch's


def test_empty_rows_and_bad_input():
    assert fd.argmax(torch.randn(0, 9, device=DEV), backend="triton").shape == (0,)
    with pytest.raises(ValueError, match="V >= 1"):
        fd.argmax(torch.randn(3, 0, device=DEV), backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        fd.argmax(torch.zeros(3, 4, dtype=torch.int32, device=DEV), backend="triton")
    with pytest.raises(ValueError, match="out must be"):
        fd.argmax(torch.randn(3, 4, device=DEV), out=torch.empty(3, dtype=torch.int32, device=DEV))


def test_config_bounds_the_chunks():
    for V in (1, 2047, 2048, 128256, 2048 * MAX_CHUNKS + 1, 10**8):
        cfg = argmax_config(V)
        n = -(-V // cfg["BLOCK"])
        assert n <= MAX_CHUNKS and cfg["PBLOCK"] >= n and cfg["BLOCK"] & (cfg["BLOCK"] - 1) == 0


@pytest.mark.gpu
def test_argmax_captured_in_a_cuda_graph_gpu():
    x = torch.randn(2, 128256, device="cuda")
    out = torch.empty(2, dtype=torch.int64, device="cuda")
    fd.argmax(x, out=out)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fd.argmax(x, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.testing.assert_close(out, torch.argmax(x, dim=-1), rtol=0, atol=0)
