"""``helpers.sm90_ptx`` runs each (snippet, arguments) once a process, and ``sm90_ptx_ahead`` runs several at once
for its later calls; a failed compile still fails (or skips) the test that asks for it, not the fixture."""

import pytest

import helpers


def test_ahead_runs_each_job_once_and_the_calls_reuse_it(monkeypatch):
    monkeypatch.setattr(helpers, "_SM90_RUNS", {})
    runs = []
    real = helpers._sm90_run
    monkeypatch.setattr(helpers, "_sm90_run", lambda args: runs.append(args[1:]) or real(args))  # args: "-c", job
    echo = "import sys; sys.stdout.write('ptx ' + ' '.join(sys.argv[1:]))"
    helpers.sm90_ptx_ahead([(echo, "a"), (echo, "b"), (echo, "a")])
    assert sorted(runs) == [(echo, "a"), (echo, "b")]
    assert helpers.sm90_ptx(echo, "b") == "ptx b" and helpers.sm90_ptx(echo, "a") == "ptx a"
    assert helpers.sm90_ptx(echo, "c") == "ptx c" and len(runs) == 3  # not run ahead: runs at its call


def test_a_failed_compile_run_ahead_fails_or_skips_at_its_call(monkeypatch):
    monkeypatch.setattr(helpers, "_SM90_RUNS", {})
    broken, no_ptxas = "raise SystemExit('kernel broken')", "raise SystemExit('ptxas not found')"
    helpers.sm90_ptx_ahead([(broken,), (no_ptxas,)])  # no error here
    with pytest.raises(AssertionError, match="kernel broken"):
        helpers.sm90_ptx(broken)
    with pytest.raises(pytest.skip.Exception, match="cannot compile for sm_90 here"):
        helpers.sm90_ptx(no_ptxas)
