"""Typed stream records: a step read from a bank or a report and written back keeps exactly its keys."""

from __future__ import annotations

import json

from editkit.runs.records import StepRecord, StreamResult, TrainingCost
from editkit.train.loop import FineTuneResult
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime

BANKED = {  # a bank entry's metrics as the stream writes them (CUDA run, then merged)
    "step": 1, "task": "digits", "pretrained": 0.1, "single_task": 0.9, "train_seconds": 12.5,
    "seconds_per_step": 0.125, "train_steps": 100, "train_size": 1297,
    "runtime": "cuda:0, bf16", "peak_gpu_bytes": 123456,
    "merged": {"per_task": {"mnist": 0.8, "digits": 0.7}, "absolute": 0.75, "normalized": 0.8},
    "bench_peak_rss_bytes": 2 ** 30,  # added to the entry later by the bench
}


def test_round_trip_keeps_every_key_and_value():
    record = StepRecord.from_dict(BANKED)
    assert record.metrics() == BANKED and list(record.metrics()) == list(BANKED)
    assert record.extra == {"bench_peak_rss_bytes": 2 ** 30} and not record.resumed
    reported = {**BANKED, "resumed": True}
    assert StepRecord.from_dict(reported).to_dict() == reported
    assert json.loads(json.dumps(record.to_dict())) == {**BANKED, "resumed": False}


def test_optional_keys_stay_absent_and_nullable_ones_stay_null():
    cpu = {k: v for k, v in BANKED.items() if k not in ("peak_gpu_bytes", "merged", "bench_peak_rss_bytes")}
    cpu["train_seconds"] = None  # a step resumed from an old bank without timings keeps null
    record = StepRecord.from_dict(cpu)
    assert record.merged is None and record.cost.peak_gpu_bytes is None and record.cost.train_seconds is None
    assert record.metrics() == cpu  # no peak_gpu_bytes / merged keys appear; train_seconds stays null
    assert "resumed" not in record.metrics()


def test_a_fresh_step_is_written_with_its_cost_between_the_scores_and_merged():
    result = FineTuneResult(task_vector={}, seconds=12.5, steps=100)
    cost = TrainingCost.of(result, 100, 1297, Runtime(precision="fp32"))
    record = StepRecord(step=1, task="digits", pretrained=0.1, single_task=0.9, cost=cost)
    assert record.metrics() == {"step": 1, "task": "digits", "pretrained": 0.1, "single_task": 0.9,
                                "train_seconds": 12.5, "seconds_per_step": 0.125, "train_steps": 100,
                                "train_size": 1297, "runtime": "cpu, fp32"}
    assert list(record.metrics()) == [k for k in BANKED if k not in ("peak_gpu_bytes", "merged", "bench_peak_rss_bytes")]


def test_final_reads_the_last_merged_step():
    steps = [StepRecord(step=0, task="a", pretrained=0.2, single_task=0.9,
                        merged={"per_task": {"a": 0.9}, "absolute": 0.9, "normalized": 1.0}),
             StepRecord(step=1, task="b", pretrained=0.3, single_task=0.8,
                        merged={"per_task": {"a": 0.6, "b": 0.7}, "absolute": 0.65, "normalized": 0.77})]
    final = StreamResult("unit", Recipe(), steps).final
    assert final == {"alpha": 1.0, "per_task": {"a": 0.6, "b": 0.7}, "absolute": 0.65, "normalized": 0.77,
                     "single_task": {"a": 0.9, "b": 0.8}, "pretrained": {"a": 0.2, "b": 0.3}}
