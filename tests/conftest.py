"""Test setup: kernels run under the Triton interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here, at collection start.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist (benchmarks/gpu.py --workers, a diagnosis): each worker gets its share of the cores. With
# torch's default (every core per process) 8 workers on the 32-core device ran the CPU tests 13 to 40
# times slower than one process on 2 cores (tests/test_quant_head.py::test_eval_accuracy_cli_reports_the_head:
# 226 s against 17 s).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# benchmarks/gpu.py tests --parts-at-once N: N pytest processes at once, each told its share
if os.environ.get("FASTDECODE_TEST_THREADS"):
    torch.set_num_threads(max(1, int(os.environ["FASTDECODE_TEST_THREADS"])))

# The one decision of this process, kept so that test_zz_process_state.py can check that no test
# module or test changed it (a module that did turned every later GPU test into an interpreter run).
TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs in every test, reproducible from the seed a failure's report prints
    (``FASTDECODE_TEST_SEED=<seed> pytest <the test>`` draws the same inputs again)."""
    fixed = os.environ.get("FASTDECODE_TEST_SEED")
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.fastdecode_seed = seed
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report names the seed its inputs came from (a section of the failure's output)."""
    report = (yield).get_result()
    seed = getattr(item, "fastdecode_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("fastdecode seed", f"rerun with FASTDECODE_TEST_SEED={seed}"))


# Per-test timings, one JSON line per finished phase, written as the run goes when
# FASTDECODE_TEST_TIMES names a file (benchmarks/gpu.py sets it): a run killed at the device's
# per-command limit still says which tests took the time and why those that failed did.
_TIMES_PATH = os.environ.get("FASTDECODE_TEST_TIMES")


def pytest_runtest_logreport(report):
    if not _TIMES_PATH or hasattr(report, "node"):  # xdist: workers write, the controller's copies are skipped
        return
    import json

    row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
           "s": round(report.duration, 3)}
    if report.failed:
        row["message"] = report.longreprtext[-1500:]
    with open(_TIMES_PATH, "a") as f:
        f.write(json.dumps(row) + "\n")
