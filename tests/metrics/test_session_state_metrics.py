"""Session state metrics: bundles, bytes and refusals by event and reason exist at 0 from
start-up, and an engine that spills, restores, imports and refuses real bundles reports each in
Prometheus exposition with the bytes the store actually holds."""

from __future__ import annotations

import re
from pathlib import Path

import prometheus_client as pc
import pytest

from shortconv.configs.session_store import SessionStoreConfig
from shortconv.engine.session_store import SessionStore
from shortconv.metrics.defs import SESSION_STATE_EVENTS, SESSION_STATE_REFUSALS
from shortconv.metrics.recorder import PrometheusClientSink, attach_metrics
from shortconv.tiny.checkpoint import make_tiny_checkpoint
from tests.engine.test_session_store import P1, engine, run
from tests.metrics.test_metrics import _promtool


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=11)


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, flags=re.M)
    assert m is not None, f"{series} not exported"
    return float(m.group(1))


def _scrape(sink: PrometheusClientSink) -> str:
    return pc.generate_latest(sink.registry).decode()


def test_refusal_reasons_cover_the_bundle_checks() -> None:
    """The reasons the engine can raise are the label values that exist from start-up."""
    import inspect

    from shortconv.cache import state_bundle
    from shortconv.engine import session_state

    raised = set()
    for mod in (state_bundle, session_state):
        raised |= set(re.findall(r'BundleError\(\s*"(\w+)"', inspect.getsource(mod)))
        raised |= set(re.findall(r'_refuse\(\s*"(\w+)"', inspect.getsource(mod)))
    raised |= {"fingerprint", "dtype", "tp_size", "page_size", "shape"}  # raised by variable
    assert raised <= set(SESSION_STATE_REFUSALS), raised - set(SESSION_STATE_REFUSALS)


def test_store_events_and_refusals_are_exported(ckpt, tmp_path: Path) -> None:
    store_cfg = {"path": str(tmp_path / "store")}
    store = SessionStore(SessionStoreConfig(path=store_cfg["path"]))
    one = engine(ckpt, store_cfg)
    (out_a, _), _ = run(one, P1, "a")
    (out_b, _), _ = run(one, P1[:9], "b")
    one.shutdown()  # spills both
    spilled = one.stats()
    sizes = {s: store.file_of(s).stat().st_size for s in "ab"}
    assert spilled.session_state_bundles["spilled"] == 2
    assert spilled.session_state_bytes["spilled"] == sum(sizes.values())
    corrupt = bytearray(store.file_of("b").read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x10
    store.file_of("b").write_bytes(bytes(corrupt))

    two = engine(ckpt, store_cfg)
    sink = PrometheusClientSink()
    attach_metrics(two, sink)
    text = _scrape(sink)
    for event in SESSION_STATE_EVENTS:
        assert _value(text, f'shortconv_session_state_bundles_total{{event="{event}"}}') == 0
        assert _value(text, f'shortconv_session_state_bytes_total{{event="{event}"}}') == 0
    for reason in SESSION_STATE_REFUSALS:
        assert _value(text, f'shortconv_session_state_refused_total{{reason="{reason}"}}') == 0

    _, cached_a = run(two, P1 + out_a + [5], "a")
    _, cached_b = run(two, P1[:9] + out_b + [5], "b")
    assert cached_a > 0 and cached_b == 0
    body = pc.generate_latest(sink.registry)
    text = body.decode()
    for event in ("imported", "restored"):
        assert _value(text, f'shortconv_session_state_bundles_total{{event="{event}"}}') == 1
        assert _value(text, f'shortconv_session_state_bytes_total{{event="{event}"}}') == sizes["a"]
    assert _value(text, 'shortconv_session_state_refused_total{reason="checksum"}') == 1
    assert _value(text, 'shortconv_session_state_refused_total{reason="fingerprint"}') == 0
    assert _value(text, 'shortconv_session_state_bundles_total{event="spilled"}') == 0
    _promtool(body)
    two.shutdown()


def test_export_counts_bytes(ckpt) -> None:
    eng = engine(ckpt)
    run(eng, P1, "s")
    data = eng.export_session("s")
    assert data is not None
    stats = eng.stats()
    assert stats.session_state_bundles["exported"] == 1
    assert stats.session_state_bytes["exported"] == len(data)
    assert stats.session_state_refused == dict.fromkeys(SESSION_STATE_REFUSALS, 0)
