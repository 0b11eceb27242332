"""fedpa.max_failed_rounds counts on the aggregator's own state; after a resume it counts on from the saved history's
trailing rounds without an aggregation (tests/integration/test_reliability_fs.py runs the stop itself)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: the resume of fedpa.max_failed_rounds is NOT checked "
    "(pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip


def test_a_resume_counts_the_trailing_rounds_without_an_aggregation():
    from fs_fedpa.plugin.resume_fs import failed_in_a_row

    records = [{"clients": [1, 2]}, {"clients": []}, {"clients": [3]}, {"clients": []}, {"clients": []}]
    assert failed_in_a_row(records) == 2
    assert failed_in_a_row(records[:3]) == 0 and failed_in_a_row([]) == 0
    assert failed_in_a_row([{"clients": []}] * 4) == 4


def test_a_new_aggregator_has_no_failed_round():
    from fs_fedpa.plugin.aggregator import FedPAAggregator

    assert FedPAAggregator(server=None).failed_in_a_row == 0
