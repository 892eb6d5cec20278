"""``bench serve``'s answer check by dtype: in fp32 a served answer that differs from the prompt generated alone is
an error (``wrong_text``, exit code 1); in bf16 the batch a row shares moves its logits by rounding, so a
difference is reported (``differs_from_alone``, ``common_prefix``) and is not an error."""

import pytest
import torch

from fastdecode.bench.serve import _common_prefix, bench_serve


def test_common_prefix():
    assert _common_prefix("abc", "abd") == 2
    assert _common_prefix("", "abc") == 0
    assert _common_prefix("abc", "abc") == 3
    assert _common_prefix("abcdef", "abc") == 3


@pytest.mark.parametrize("dtype,exact", [(torch.float32, True), (torch.bfloat16, False)])
def test_bf16_rows_report_differences_fp32_rows_count_them_wrong(dtype, exact):
    pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'fastdecode[serve]'")
    pytest.importorskip("uvicorn", reason="needs the serve extra: pip install 'fastdecode[serve]'")
    rows = bench_serve("tiny", concurrency=[3], duration=0.5, input_len=4, output_len=4, max_batch=2,
                       prefill_chunk=4, device="cpu", dtype=dtype, static=False)
    [r] = rows
    assert r["completed"] == r["requests"] >= 3 and r["failed"] == 0
    if exact:
        assert r["wrong_text"] == 0 and "differs_from_alone" not in r and "common_prefix" not in r
    else:
        assert "wrong_text" not in r and 0 <= r["differs_from_alone"] <= r["completed"]
        assert 0.0 <= r["common_prefix"] <= 1.0
