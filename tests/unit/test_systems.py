"""What a piece of work cost (fs_fedpa.systems): the span's seconds against the clock, its peak memory against an
allocation of known size, the token counts against the masks, and the DP policies keeping a client's timings."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from fs_fedpa.systems import SYSTEMS_STATS, Span, TrainCounter, round_stats


def test_a_span_measures_the_wall_time_of_its_work():
    before = time.perf_counter()
    with Span() as span:
        time.sleep(0.05)
    assert 0.05 <= span.seconds <= time.perf_counter() - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the per-span peak RSS needs Linux's clear_refs")
def test_the_peak_memory_of_a_span_is_its_own_not_the_process_lifetimes():
    size = 400 * 2**20
    with Span("cpu") as big:
        block = torch.ones(size // 4)  # written, so resident
        del block
    with Span("cpu") as small:
        torch.ones(1024)
    assert big.kind == small.kind == "rss"
    assert big.peak >= size  # the process's resident set held the block at least
    assert small.peak < big.peak - size // 2  # the second span's peak started anew


def test_the_counter_counts_batches_examples_and_the_masks_tokens():
    counter = TrainCounter()
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1]])]
    for mask in masks:
        counter.count({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, len(mask))
    counter.count({"input_ids": torch.zeros(2, 5)}, 2)  # no mask: every input id is a token
    assert counter.take() == {"batches": 3, "examples": 5, "tokens": sum(int(m.sum()) for m in masks) + 10}
    counter.count((torch.zeros(2, 3), torch.zeros(2)), 2)  # a batch that is not a dict: no tokens to count
    assert counter.take() == {"batches": 1, "examples": 2}


def test_a_rounds_statistics_are_the_systems_ones():
    span = Span()
    span.seconds, span.peak = 2.0, 123
    stats = round_stats(span, {"batches": 4, "examples": 16, "tokens": 512})
    assert set(stats) == set(SYSTEMS_STATS)
    assert stats["sys_train_seconds"] == 2.0 and stats["sys_train_tokens"] == 512 and stats["sys_peak_memory"] == 123


def test_under_dp_a_clients_timings_stay_with_it():
    """A client's timings and counts depend on how many records its round drew: neither DP policy lets them out
    (the sample-level one passes every other statistic but the raw gradient's)."""
    from fs_fedpa.privacy.client_level import ClientLevelClient
    from fs_fedpa.privacy.sample_level import SampleLevelClient

    stats = {"alignment_loss": 0.5, "state_lost": 0, **{k: 1.0 for k in SYSTEMS_STATS}}
    sample = SampleLevelClient.__new__(SampleLevelClient)
    sample.spent = lambda rounds: {}  # what it spent is not this test's
    assert SampleLevelClient.stats(sample, stats) == {"alignment_loss": 0.5, "state_lost": 0}
    assert ClientLevelClient.stats(ClientLevelClient.__new__(ClientLevelClient), stats) == {"state_lost": 0}
