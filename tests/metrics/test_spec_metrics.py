"""Speculative decoding's metrics: per-method counters, acceptance by position and the
accepted-length histogram, in real Prometheus exposition (prometheus_client, promtool) and in
the stats snapshot `/v1/internal/stats` serves; one engine run checks the figures agree."""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

import prometheus_client as pc

from shortconv.metrics.recorder import MetricsRecorder, PrometheusClientSink, serve_metrics
from tests.engine.test_spec_decode import GREEDY, PROMPTS, make_ckpt
from tests.metrics.test_metrics import IDLE, _promtool

K3 = replace(
    IDLE,
    spec_decode_num_accepted_tokens_per_pos={"0": 0, "1": 0, "2": 0},
    spec_decode_accepted_lengths=(0, 0, 0, 0),
)


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, flags=re.M)
    assert m is not None, f"{series} not exported"
    return float(m.group(1))


def test_exporter_series_from_start_and_after_verifies() -> None:
    sink = PrometheusClientSink()
    rec = MetricsRecorder(sink, K3)
    text = pc.generate_latest(sink.registry).decode()
    for pos in "012":
        assert (
            _value(
                text, f'shortconv_spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'
            )
            == 0
        )
    for method in ("ngram", "draft_model"):
        assert _value(text, f'shortconv_spec_decode_num_drafts_total{{method="{method}"}}') == 0
    assert _value(text, "shortconv_spec_decode_accepted_length_count") == 0
    # Three verify rows of k = 3 that kept 0, 2 and 3 proposals.
    rec.record(
        replace(
            K3,
            spec_decode_num_drafts_by_method={"ngram": 3, "draft_model": 0},
            spec_decode_num_draft_tokens_by_method={"ngram": 9, "draft_model": 0},
            spec_decode_num_accepted_tokens_by_method={"ngram": 5, "draft_model": 0},
            spec_decode_num_accepted_tokens_per_pos={"0": 2, "1": 2, "2": 1},
            spec_decode_accepted_lengths=(1, 0, 1, 1),
        )
    )
    body = pc.generate_latest(sink.registry)
    text = body.decode()
    assert _value(text, 'shortconv_spec_decode_num_draft_tokens_total{method="ngram"}') == 9
    assert _value(text, 'shortconv_spec_decode_num_accepted_tokens_total{method="ngram"}') == 5
    assert (
        _value(text, 'shortconv_spec_decode_num_accepted_tokens_total{method="draft_model"}') == 0
    )
    assert (
        _value(text, 'shortconv_spec_decode_num_accepted_tokens_per_pos_total{position="2"}') == 1
    )
    assert _value(text, "shortconv_spec_decode_accepted_length_count") == 3
    assert _value(text, "shortconv_spec_decode_accepted_length_sum") == 5
    assert _value(text, 'shortconv_spec_decode_accepted_length_bucket{le="0.5"}') == 1
    assert _value(text, 'shortconv_spec_decode_accepted_length_bucket{le="1.5"}') == 1
    assert _value(text, 'shortconv_spec_decode_accepted_length_bucket{le="2.5"}') == 2
    rec.record(replace(K3, spec_decode_accepted_lengths=(1, 0, 1, 1)))  # no new rows
    text = pc.generate_latest(sink.registry).decode()
    assert _value(text, "shortconv_spec_decode_accepted_length_count") == 3
    _promtool(body)


def test_engine_run_figures_agree(tmp_path: Path) -> None:
    """Per-position counts sum to the accepted total; the histogram counts every verify row
    and sums to the accepted total; the stats snapshot carries the same, JSON-ready."""
    from shortconv.llm import LLM

    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(make_ckpt("lfm2", tmp_path), dtype="float32", speculative_config=spec)
    server = serve_metrics(llm)
    try:
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            text = resp.read().decode()
        stats = llm.engine.stats()
    finally:
        server.close()
        llm.shutdown()
    accepted = _value(text, 'shortconv_spec_decode_num_accepted_tokens_total{method="ngram"}')
    drafts = _value(text, 'shortconv_spec_decode_num_drafts_total{method="ngram"}')
    proposed = _value(text, 'shortconv_spec_decode_num_draft_tokens_total{method="ngram"}')
    assert 0 < accepted < proposed, "both accepted and rejected proposals, or it proves nothing"
    per_pos = [
        _value(text, f'shortconv_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
        for i in range(3)
    ]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 kept only after i
    assert _value(text, "shortconv_spec_decode_accepted_length_count") == drafts
    assert _value(text, "shortconv_spec_decode_accepted_length_sum") == accepted
    snapshot = json.loads(json.dumps(asdict(stats)))  # what /v1/internal/stats returns
    assert snapshot["spec_decode_num_accepted_tokens_by_method"]["ngram"] == accepted
    assert sum(snapshot["spec_decode_num_accepted_tokens_per_pos"].values()) == accepted
    lengths = snapshot["spec_decode_accepted_lengths"]
    assert sum(lengths) == drafts and sum(n * c for n, c in enumerate(lengths)) == accepted


def test_every_histogram_is_one_ray_accepts() -> None:
    """Ray's Histogram refuses a boundary <= 0: one such bucket made every replica's metrics
    sink fail to start (serve run answered 503 for ever). Checked here, without Ray running."""
    from ray.util.metrics import Histogram

    from shortconv.metrics.defs import METRICS

    for m in METRICS:
        if m.buckets:
            Histogram(f"bounds_check_{m.name}", boundaries=list(m.buckets))
