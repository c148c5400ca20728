"""The refit's bookkeeping: searches shared between folds repeat nothing and change nothing, and
an interrupted refit resumes from the fits it finished."""

from __future__ import annotations

import pytest
import yaml

from stage_dse.validation.corpus import load_corpus
from stage_dse.validation.fit import (
    ALL_SOURCES,
    Parameter,
    Problem,
    checkpoint_dir,
    fit,
    leave_one_source_out,
)

CASES = load_corpus()
A100 = Parameter("gemm_efficiency/a100", ("gemm_efficiency",), 0.5, 0.93, hardware=("a100_80gb",))
H100 = Parameter("gemm_efficiency/h100", ("gemm_efficiency",), 0.5, 0.86, hardware=("h100_sxm",))
PARAMS = [A100, H100]


@pytest.fixture(scope="module")
def problem():
    def some(source, n):
        return [c for c in CASES if c.source.id == source][:n]

    cases = some("narayanan2021_t1", 3) + some("korthikanti2022_t4", 2) + some("llama3_t4", 1)
    return Problem(cases)


def test_shared_searches_give_the_folds_a_search_of_their_own_gives(problem):
    """A fold reuses an earlier search only where it would repeat it step for step: the folds
    with the shared searches equal the folds fitted from scratch, parameter for parameter."""
    result, _ = leave_one_source_out(problem, PARAMS, workers=1)
    assert result.theta == fit(problem, PARAMS)
    for source, fold in result.folds.items():
        assert fold == fit(problem, PARAMS, exclude=source), source
    # the H100 search is the same in both A100 folds (no A100 source touches an H100 case)
    memo: dict = {}
    fit(problem, PARAMS, memo=memo)
    searches = len(memo)
    fit(problem, PARAMS, exclude="korthikanti2022_t4", memo=memo)
    assert len(memo) < 2 * searches


def test_an_interrupted_refit_resumes_from_the_fits_it_finished(problem, tmp_path):
    saved = tmp_path / "fit"
    first, out = leave_one_source_out(problem, PARAMS, workers=1, checkpoint=saved)
    names = sorted(p.stem for p in saved.glob("*.yaml"))
    assert names == sorted([ALL_SOURCES, *first.folds])
    # one fit lost (killed before it was written), one written half: both are refitted
    (saved / "llama3_t4.yaml").unlink()
    (saved / "narayanan2021_t1.yaml").write_text("gemm_efficiency/a100: [")
    # one kept fit is read back rather than refitted: a marked value shows it
    kept = yaml.safe_load((saved / "korthikanti2022_t4.yaml").read_text())
    kept[A100.name] = 0.777
    (saved / "korthikanti2022_t4.yaml").write_text(yaml.safe_dump(kept))
    again, out2 = leave_one_source_out(problem, PARAMS, workers=1, checkpoint=saved)
    assert again.theta == first.theta
    assert again.folds["llama3_t4"] == first.folds["llama3_t4"]
    assert again.folds["narayanan2021_t1"] == first.folds["narayanan2021_t1"]
    assert again.folds["korthikanti2022_t4"][A100.name] == 0.777
    assert (saved / "llama3_t4.yaml").is_file()
    assert out2["fit_err_pct"].tolist() == out["fit_err_pct"].tolist()
    same = out2["source"] != "korthikanti2022_t4"
    assert out2.loc[same, "loso_err_pct"].tolist() == out.loc[same, "loso_err_pct"].tolist()


def test_a_checkpoint_names_everything_a_fit_depends_on(problem):
    here = checkpoint_dir(problem, PARAMS, "corpus-a")
    assert checkpoint_dir(problem, PARAMS, "corpus-a") == here
    assert checkpoint_dir(problem, PARAMS, "corpus-b") != here
    assert checkpoint_dir(problem, [A100], "corpus-a") != here
    assert checkpoint_dir(problem.retimed("measured"), PARAMS, "corpus-a") != here
    assert checkpoint_dir(problem.subset(problem.cases[:3]), PARAMS, "corpus-a") != here


@pytest.mark.parametrize("workers", [1, 2])
def test_a_refit_reports_each_fit_as_it_ends(problem, tmp_path, workers):
    """One report per fit, counted in order, the all-source fit first; a resumed refit reports
    the fits it reads back too."""
    calls: list = []
    saved = tmp_path / "fit"
    result, _ = leave_one_source_out(
        problem, PARAMS, workers=workers, checkpoint=saved, progress=lambda *a: calls.append(a)
    )
    total = len(result.folds) + 1
    assert [c[:2] for c in calls] == [(i, total) for i in range(1, total + 1)]
    assert calls[0][2] == ALL_SOURCES
    assert sorted(c[2] for c in calls[1:]) == sorted(result.folds)
    (saved / "llama3_t4.yaml").unlink()
    again: list = []
    leave_one_source_out(
        problem, PARAMS, workers=workers, checkpoint=saved, progress=lambda *a: again.append(a)
    )
    assert [c[:2] for c in again] == [c[:2] for c in calls]
    assert again[-1][2] == "llama3_t4"  # the one refitted, after those read back
