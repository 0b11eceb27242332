"""GLUE metrics against scikit-learn / scipy as independent references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.tasks.metrics import accuracy, f1_binary, glue_metrics, matthews_corr, pearson, spearman

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")

labels = st.integers(1, 60).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 2), min_size=n, max_size=n), st.lists(st.integers(0, 2), min_size=n, max_size=n)
    )
)


@settings(max_examples=150, deadline=None)
@given(labels)
def test_classification_metrics_match_sklearn(pair):
    y, p = map(np.array, pair)
    assert accuracy(y, p) == pytest.approx(sklearn_metrics.accuracy_score(y, p))
    yb, pb = (y == 1).astype(int), (p == 1).astype(int)
    assert f1_binary(yb, pb) == pytest.approx(sklearn_metrics.f1_score(yb, pb, zero_division=0.0))
    assert matthews_corr(y, p) == pytest.approx(sklearn_metrics.matthews_corrcoef(y, p), abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 5), st.floats(-10, 10)), min_size=3, max_size=40))
def test_correlations_match_scipy(points):
    x = np.array([a for a, _ in points], dtype=float)
    y = np.array([b for _, b in points], dtype=float)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        assert pearson(x, y) == 0.0
        return
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-9)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-9)


def test_glue_metrics_per_task():
    y, p = [0, 1, 1, 0], [0, 1, 0, 0]
    assert set(glue_metrics("sst2", y, p)) == {"acc"}
    assert set(glue_metrics("qqp", y, p)) == {"acc", "f1"}
    assert set(glue_metrics("cola", y, p)) == {"mcc"}
    assert set(glue_metrics("stsb", [0.1, 2.0, 3.5], [0.0, 2.2, 3.0])) == {"pearson", "spearman"}


@pytest.mark.parametrize("call", [lambda: accuracy([], []), lambda: f1_binary([1, 0], [1])])
def test_metric_inputs_are_checked(call):
    with pytest.raises(ValueError, match="need equally long, non-empty y_true and y_pred"):
        call()
