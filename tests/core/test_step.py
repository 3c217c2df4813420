"""GrammarStep: one verify step's grammar work, driven the way an integration drives it (no SGLang, no engine).

Real xgrammar matchers on the ``regex`` grammar, three requests at different points of their documents, one small
draft tree per request (topk 2, 2 steps, 5 nodes; first child = true continuation; the batch of
``test_mask_failures.py``)::

    0 ── 1 ── 3
    │    └─── 4
    └─── 2

The step module's clock is replaced by a hand-driven one (``Clock``): the barrier, the tree wait and the upload fence
each move it by a known amount, so every duration the step records, reports and stamps is an exact number, with no
wall-clock timing in the assertions.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, List, Tuple

import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest, PendingTree

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core import step as step_mod
from sglang_eagle_overlap.core import telemetry as telemetry_mod
from sglang_eagle_overlap.core import timeline as T
from sglang_eagle_overlap.core.step import GrammarStep, StepMask
from sglang_eagle_overlap.settings import Settings, default_mask_threads
from sglang_eo_dev.helpers import grammars as G
from tests.core.test_mask_failures import N, VOCAB, BrokenGrammar, _setup
from sglang_eo_dev.helpers.steps import feed_one, make_step

CPU = torch.device("cpu")


class Clock:
    """Stands in for the ``time`` module inside core/step.py: ``perf_counter`` / ``monotonic`` only move when told."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(step_mod, "time", c)
    monkeypatch.setattr(telemetry_mod, "time", c)
    return c


class Probe:
    """Records the probe calls; ``on_mask_ready`` answers a fixed "not hidden" time."""

    def __init__(self, unhidden: float = 0.5) -> None:
        self.unhidden = unhidden
        self.calls: List[Tuple[Any, ...]] = []

    def on_launch(self, device: Any = None) -> None:
        self.calls.append(("launch", device))

    def on_mask_start(self, device: Any = None, t: Any = None) -> None:
        self.calls.append(("mask_start", device, t))

    def on_mask_ready(self, t_ready: float) -> float:
        self.calls.append(("mask_ready", t_ready))
        return self.unhidden


class Exporter:
    def __init__(self) -> None:
        self.steps: List[Tuple[float, float, int]] = []

    def observe_step(self, grammar_s: float, unhidden_s: float, timeouts: int, *, forced_proposed: int = 0,
                     forced_accepted: int = 0) -> None:
        self.steps.append((grammar_s, unhidden_s, timeouts))


class Fence:
    """Stands in for the previous step's upload event: waiting on it costs ``cost`` seconds of the fake clock."""

    def __init__(self, clock: Clock, cost: float) -> None:
        self.clock, self.cost, self.waited = clock, cost, 0

    def synchronize(self) -> None:
        self.waited += 1
        self.clock.now += self.cost


class SlowTree:
    """A pending tree whose host copy takes ``cost`` seconds of the fake clock to arrive."""

    def __init__(self, tree, clock: Clock, cost: float) -> None:
        self.tree, self.clock, self.cost, self.resolved = tree, clock, cost, 0

    def resolve(self):
        self.resolved += 1
        self.clock.now += self.cost
        return self.tree


def _batch():
    """Matchers (fresh each call, same states) and the batch's tree tensors ``[3, 5]`` (the tree drawn above)."""
    return _setup()


def _reference_mask() -> torch.Tensor:
    matchers, nxt, sib, tok = _batch()
    built = TreeMaskBuilder(threads=1).build([MaskRequest(matcher=m) for m in matchers], nxt, sib, tok, VOCAB)
    assert built.bitmask is not None and not bool((built.bitmask[N + 1] == -1).all())  # a real, filled mask
    return built.bitmask.clone()


# -- construction ----------------------------------------------------------------------------------------------------
def test_builder_is_made_once_from_the_step_settings():
    step = make_step(mask_threads=3, mask_time_limit_s=0.25, pin_memory=False)
    b = step.builder
    assert b is step.builder
    assert (b.threads, b.time_limit_s, b.pin_memory) == (3, 0.25, False)
    assert make_step(pin_memory=True).builder.pin_memory is True  # an explicit choice wins over the detection


def test_defaults_follow_the_documented_settings():
    step = make_step()
    defaults = Settings()
    assert step.builder.time_limit_s == defaults.mask_time_limit_s
    assert step.telemetry.log_interval_s == defaults.log_interval_s
    assert step.builder.threads == default_mask_threads()
    # Pinned host memory only where a device runtime can pin it.
    assert step.builder.pin_memory is bool(torch.cuda.is_available())
    assert not step.telemetry.timeline.enabled and step.telemetry.stats_file is None



@pytest.mark.parametrize("upload_stream", [None, False, True])
def test_a_step_given_no_parts_makes_its_own_with_the_documented_defaults(upload_stream):
    """``GrammarStep()`` alone: the default settings, and a telemetry part of its own whose log period is the
    documented one; given settings, the mask upload uses a side stream exactly when they say so."""
    from sglang_eagle_overlap.core.step import StepConfig
    from sglang_eagle_overlap.core.telemetry import StepTelemetry

    step = GrammarStep() if upload_stream is None else GrammarStep(StepConfig(upload_stream=upload_stream))
    try:
        assert step.config == (StepConfig() if upload_stream is None else StepConfig(upload_stream=upload_stream))
        assert type(step.telemetry) is StepTelemetry
        assert step.telemetry.log_interval_s == Settings().log_interval_s
        assert step.uploader.side_stream is bool(upload_stream)
    finally:
        step.close()

# -- 1. tree copy ----------------------------------------------------------------------------------------------------
def test_copy_tree_stamps_the_launch_and_hands_back_the_tree(tmp_path):
    probe = Probe()
    tl = T.Timeline(str(tmp_path / "tl.json"))
    step = make_step(probe=probe, timeline=tl)
    _, nxt, sib, tok = _batch()
    pending = step.copy_tree(nxt, sib, tok.reshape(-1))
    assert isinstance(pending, PendingTree)
    h_nxt, h_sib, h_tok = pending.resolve()
    assert h_nxt is nxt and h_sib is sib and torch.equal(h_tok, tok.reshape(-1))  # the flat draft as it came
    assert probe.calls == [("launch", nxt.device)]
    assert [e[0] for e in tl.events()] == ["tree_copy"]


# -- 2./4. the exactly-once advance ----------------------------------------------------------------------------------
def test_feed_is_the_ledger_feed():
    step = make_step()
    g = G.Recorder()
    out = feed_one(step, "r", g, 0, [1, 2])
    assert out.retained == (1, 2) and g.fed == [1, 2]
    assert feed_one(step, "r", g, 0, [1, 2]) is out and g.fed == [1, 2]  # a replay feeds nothing
    assert step.ledger.consumed("r") == 2 and step.telemetry.stats.counters["ledger_resets"] == 0


def test_feed_reanchors_on_a_gap_instead_of_raising(caplog):
    step = make_step()
    g = G.Recorder()
    feed_one(step, "req-7", g, 0, [1, 2])
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
        out = feed_one(step, "req-7", g, 5, [9])  # the host moved the matcher to 5 behind the ledger's back
    assert out.retained == (9,) and out.start == 5 and g.fed == [1, 2, 9]
    assert step.ledger.consumed("req-7") == 6
    assert step.telemetry.stats.counters["ledger_resets"] == 1
    msg = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msg) == 1 and "never fed" in msg[0]
    assert msg[0].startswith("sglang-eagle-overlap: re-anchoring grammar ledger of request req-7 at position 5: ")


def test_feed_reanchors_on_a_conflict_instead_of_raising(caplog):
    step = make_step()
    g = G.Recorder()
    feed_one(step, "r", g, 0, [1, 2])
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
        out = feed_one(step, "r", g, 0, [4])  # the same position asked with other tokens: the host rolled back
    assert out.retained == (4,) and g.fed == [1, 2, 4]
    assert step.ledger.consumed("r") == 1 and step.telemetry.stats.counters["ledger_resets"] == 1
    assert any("advanced with [1, 2]" in r.getMessage() for r in caplog.records)


# -- prune -----------------------------------------------------------------------------------------------------------
def _fill_ledger(step: GrammarStep, k: int) -> None:
    for i in range(k):
        feed_one(step, f"q{i}", G.Recorder(), 0, [1])


def test_prune_forgets_finished_requests():
    step = make_step()
    _fill_ledger(step, 3)
    step.prune(live=["q0", "q1", "q2"], finished=["q1"])
    assert "q1" not in step.ledger and "q0" in step.ledger and "q2" in step.ledger
    assert step.telemetry.stats.counters["ledger_forgets"] == 0  # finished requests are not "forgets"


@pytest.mark.parametrize("entries,live,left", [
    (64, 0, 64),  # at most 64 entries are kept whatever the batch
    (65, 0, 0),
    (80, 20, 80),  # ... or 4 per live request
    (81, 20, 20),
])
def test_prune_retains_only_live_requests_once_the_ledger_outgrows_the_batch(entries, live, left):
    step = make_step()
    _fill_ledger(step, entries)
    alive = [f"q{i}" for i in range(live)]
    step.prune(live=alive)
    assert len(step.ledger) == left
    assert all(k in step.ledger for k in alive)
    assert step.telemetry.stats.counters["ledger_forgets"] == entries - left


# -- 2./3. the mask ----------------------------------------------------------------------------------------------------
def test_build_mask_runs_barrier_then_tree_then_build_and_records_every_phase(clock, tmp_path):
    probe, exporter = Probe(unhidden=0.5), Exporter()
    tl = T.Timeline(str(tmp_path / "tl.json"))
    step = make_step(probe=probe, exporter=exporter, timeline=tl, mask_time_limit_s=None)
    matchers, nxt, sib, tok = _batch()
    reqs = [MaskRequest(matcher=m, request_id=f"r{i}") for i, m in enumerate(matchers)]
    tree = SlowTree((nxt, sib, tok.reshape(-1)), clock, cost=3.0)
    order: List[str] = []

    def barrier() -> None:
        order.append(f"barrier resolved={tree.resolved}")
        clock.now += 2.0

    fence = Fence(clock, cost=5.0)
    step.uploader._event = fence  # the previous step's upload into the reused host buffer
    t0 = clock.now
    out = step.build_mask(reqs, tree, vocab_size=VOCAB, device=CPU, barrier=barrier, draft_device=None)

    assert isinstance(out, StepMask)
    assert order == ["barrier resolved=0"] and tree.resolved == 1 and fence.waited == 1
    assert step.uploader.take_fence() is None  # a CPU mask needs no fence for the next step
    assert torch.equal(out.tree.bitmask, _reference_mask())
    assert out.device_mask is out.tree.bitmask  # CPU: the sampler reads the builder's buffer
    assert out.tree.failed == [] and out.tree.timed_out == []
    # Durations: barrier 2 s, tree wait 3 s, fence + build + upload 5 s (the build itself takes no fake time).
    s = step.telemetry.stats
    assert (s.steps, s.advance_s, s.tree_wait_s, s.mask_s, s.unhidden_s) == (1, 2.0, 3.0, 5.0, 0.5)
    assert s.last["bs"] == 3.0 and s.mask_timeouts == 0 and s.counters["mask_failures"] == 0
    assert probe.calls == [("mask_start", CPU, t0), ("mask_ready", t0 + 10.0)]
    assert exporter.steps == [(10.0, 0.5, 0)]
    assert tl.events() == [
        ("advance", t0, t0 + 2.0, 3, True),
        ("tree_wait", t0 + 2.0, t0 + 5.0, 3, True),
        ("mask_build", t0 + 5.0, t0 + 10.0, 3, True),
        ("mask_upload", t0 + 10.0, t0 + 10.0, 3, True),
        ("sample", t0 + 10.0, t0 + 10.0, 3, True),
    ]
    # Every matcher is back where it was.
    for m, ref in zip(matchers, _batch()[0]):
        assert torch.equal(G.next_token_bitmask(m, VOCAB), G.next_token_bitmask(ref, VOCAB))


class DisabledExporter(Exporter):
    """An exporter that says it takes no steps (``PrometheusExporter`` without ``--enable-metrics``)."""

    enabled = False


@pytest.mark.parametrize("enabled", [False, True])
def test_an_exporter_is_called_only_when_it_is_enabled(enabled):
    exporter = Exporter() if enabled else DisabledExporter()
    step = make_step(exporter=exporter, mask_time_limit_s=None)
    matchers, nxt, sib, tok = _batch()
    reqs = [MaskRequest(matcher=m, request_id=f"r{i}") for i, m in enumerate(matchers)]
    for _ in range(2):
        out = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok.reshape(-1)), resolved=True), vocab_size=VOCAB,
                              device=CPU, draft_device=None)
        assert torch.equal(out.tree.bitmask, _reference_mask())
    assert step.telemetry.stats.steps == 2 and step.telemetry.stats.last["bs"] == 3.0  # the step's own numbers either way
    assert len(exporter.steps) == (2 if enabled else 0)


def test_build_mask_without_barrier_and_with_the_default_probe(clock):
    step = make_step(mask_time_limit_s=None)
    matchers, nxt, sib, tok = _batch()
    out = step.build_mask([MaskRequest(matcher=m) for m in matchers], SlowTree((nxt, sib, tok), clock, 1.5),
                          vocab_size=VOCAB, device=CPU)
    assert torch.equal(out.device_mask, _reference_mask())
    assert (step.telemetry.stats.advance_s, step.telemetry.stats.tree_wait_s, step.telemetry.stats.unhidden_s) == (0.0, 1.5, 0.0)


class DeviceModule:
    """Stands in for ``torch.cuda`` as ``torch.get_device_module`` returns it for the ``meta`` device: its events
    count records and waits."""

    def __init__(self) -> None:
        self.events: List[Any] = []

    def Event(self):  # noqa: N802 -- torch's name
        module = self

        class Event:
            waits = 0

            def record(self) -> None:
                module.events.append(self)

            def synchronize(self) -> None:
                self.waits += 1

        return Event()


def test_device_upload_is_fenced_before_the_next_build_reuses_the_buffer(clock, monkeypatch):
    """A mask uploaded to a device (``meta`` here: a device that needs no hardware) records an event after the
    upload; the next step waits on it before it overwrites the host buffer."""
    module = DeviceModule()

    def get_device_module(device):
        assert torch.device(device).type == "meta", device
        return module

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    step = make_step(mask_time_limit_s=None)
    meta = torch.device("meta")
    matchers, nxt, sib, tok = _batch()
    reqs = [MaskRequest(matcher=m) for m in matchers]
    first = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=meta)
    assert first.device_mask.device.type == "meta" and first.device_mask.shape == first.tree.bitmask.shape
    assert len(module.events) == 1 and module.events[0].waits == 0
    second = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=meta)
    assert module.events[0].waits == 1 and len(module.events) == 2 and module.events[1].waits == 0
    assert torch.equal(second.tree.bitmask, _reference_mask())


def test_unconstrained_batch_has_no_device_mask(clock):
    exporter = Exporter()
    step = make_step(exporter=exporter)
    _, nxt, sib, tok = _batch()
    out = step.build_mask([MaskRequest(), MaskRequest(), MaskRequest()], PendingTree(host=(nxt, sib, tok)),
                          vocab_size=VOCAB, device=CPU, draft_device=tok.reshape(-1).clone())
    assert out.device_mask is None and out.tree.bitmask is None
    assert step.telemetry.stats.steps == 1 and exporter.steps == [(0.0, 0.0, 0)]


def test_failed_request_has_its_drafts_neutralised_and_is_counted(clock):
    matchers, nxt, sib, tok = _batch()
    broken = BrokenGrammar(matchers[1], ok_fills=0)
    reqs = [MaskRequest(matcher=matchers[0]), MaskRequest(grammar=broken, request_id="bad"),
            MaskRequest(matcher=matchers[2])]
    draft = tok.reshape(-1).clone()
    step = make_step(mask_time_limit_s=None)
    out = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=CPU,
                          draft_device=draft)
    assert [i for i, _ in out.tree.failed] == [1]
    view = draft.view(3, N)
    assert torch.equal(view[0], tok[0]) and torch.equal(view[2], tok[2])
    assert int(view[1, 0]) == int(tok[1, 0]) and view[1, 1:].tolist() == [-1] * (N - 1)
    assert step.telemetry.stats.counters["mask_failures"] == 1 and step.telemetry.stats.mask_timeouts == 0
    ref = _reference_mask()
    assert torch.equal(out.device_mask[:N], ref[:N]) and torch.equal(out.device_mask[2 * N :], ref[2 * N :])
    assert bool((out.device_mask[N : 2 * N] == -1).all())


def test_failed_request_without_a_draft_tensor_is_left_to_the_caller(clock):
    """No ``draft_device``: nothing to neutralise; the failure is still reported (the host aborts the request)."""
    matchers, nxt, sib, tok = _batch()
    reqs = [MaskRequest(matcher=matchers[0]), MaskRequest(grammar=BrokenGrammar(matchers[1], ok_fills=0))]
    step = make_step(mask_time_limit_s=None)
    out = step.build_mask(reqs, PendingTree(host=(nxt[:2], sib[:2], tok[:2])), vocab_size=VOCAB, device=CPU)
    assert [i for i, _ in out.tree.failed] == [1] and step.telemetry.stats.counters["mask_failures"] == 1


def test_time_limit_applies_only_when_drafts_can_be_neutralised(clock):
    exporter = Exporter()
    step = make_step(mask_time_limit_s=1e-9, exporter=exporter)  # every walk is over the limit
    matchers, nxt, sib, tok = _batch()
    reqs = [MaskRequest(matcher=m) for m in matchers]
    ref = _reference_mask()
    # No draft tensor: the build may not give up on any request, so it runs without the limit.
    exact = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=CPU)
    assert exact.tree.timed_out == [] and torch.equal(exact.device_mask, ref)
    # With it: every request keeps its exact root row, its other drafts become unmatchable.
    draft = tok.reshape(-1).clone()
    cut = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=CPU,
                          draft_device=draft)
    assert sorted(cut.tree.timed_out) == [0, 1, 2]
    view = draft.view(3, N)
    assert view[:, 0].tolist() == tok[:, 0].tolist() and bool((view[:, 1:] == -1).all())
    for i in range(3):
        assert torch.equal(cut.device_mask[i * N], ref[i * N])
    assert step.telemetry.stats.mask_timeouts == 3 and step.telemetry.stats.steps == 2
    assert [t for _, _, t in exporter.steps] == [0, 3]


# -- reporting -------------------------------------------------------------------------------------------------------
def _unconstrained_step(step: GrammarStep) -> None:
    _, nxt, sib, tok = _batch()
    step.build_mask([MaskRequest()] * 3, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=CPU)


def _lines(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if "grammar verify steps" in r.getMessage()]


def test_log_line_on_the_first_step_then_every_interval(clock, caplog):
    step = make_step(log_interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        _unconstrained_step(step)
        assert len(_lines(caplog)) == 1
        clock.now += 9.0
        _unconstrained_step(step)
        assert len(_lines(caplog)) == 1  # inside the interval: no line
        clock.now += 1.0
        _unconstrained_step(step)  # exactly one interval after the first line
        assert len(_lines(caplog)) == 2
        clock.now += 4.0
        _unconstrained_step(step)
        assert len(_lines(caplog)) == 2
    assert _lines(caplog)[-1].startswith("sglang-eagle-overlap: 3 grammar verify steps")


def test_log_line_carries_the_per_step_numbers(clock, caplog):
    step = make_step(probe=Probe(unhidden=0.25), mask_time_limit_s=None)
    feed_one(step, "a", G.Recorder(), 0, [1])
    step.telemetry.stats.count("aborts", 2)
    _, nxt, sib, tok = _batch()

    def barrier() -> None:
        clock.now += 0.001

    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        step.build_mask([MaskRequest()] * 3, SlowTree((nxt, sib, tok), clock, 0.002), vocab_size=VOCAB,
                        device=CPU, barrier=barrier)
    (line,) = _lines(caplog)
    for part in ("sglang-eagle-overlap: 1 grammar verify steps; per step: grammar 3.000 ms (advance 1.000, tree wait "
                 "2.000, mask 0.000)", "not hidden by the forward 250.000 ms; 0 mask time-limit hits; forced drafts "
                 "off (0 proposed, 0 changed, 0 accepted); ledger 1 requests; ", "'aborts': 2", "'ledger_resets': 0"):
        assert part in line, (part, line)


def test_snapshot_holds_the_step_numbers_counters_and_host_state(clock):
    step = make_step(state=lambda: {"active": True, "steps": "from the host"})
    feed_one(step, "a", G.Recorder(), 0, [1, 2, 3])
    feed_one(step, "b", G.Recorder(), 0, [4])
    step.telemetry.stats.count("aborts")
    _, nxt, sib, tok = _batch()
    step.build_mask([MaskRequest()] * 3, SlowTree((nxt, sib, tok), clock, 0.5), vocab_size=VOCAB, device=CPU)
    snap = step.telemetry.snapshot()
    assert snap["active"] is True and snap["steps"] == "from the host"  # the host's fields come last
    assert (snap["tree_wait_s"], snap["grammar_s"], snap["advance_s"], snap["mask_s"]) == (0.5, 0.5, 0.0, 0.0)
    assert snap["unhidden_s"] == 0.0 and snap["mask_timeouts"] == 0
    assert snap["tokens_advanced"] == 4 and snap["ledger_requests"] == 2
    assert snap["pinned_allocations"] == 0 and snap["pid"] == os.getpid()
    assert snap["aborts"] == 1 and snap["mask_failures"] == 0
    plain = make_step().telemetry.snapshot()
    assert plain["steps"] == 0 and "active" not in plain


def test_stats_file_rewritten_every_step(clock, tmp_path):
    path = tmp_path / "stats.json"
    step = make_step(stats_file=str(path), log_interval_s=1e9)
    _unconstrained_step(step)
    assert json.loads(path.read_text())["steps"] == 1
    _unconstrained_step(step)
    data = json.loads(path.read_text())
    assert data["steps"] == 2 and data["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path)) == ["stats.json"]  # the temporary file was moved into place


def test_stats_file_that_cannot_be_written_never_fails_a_step(clock, tmp_path, caplog):
    path = tmp_path / "missing-dir" / "stats.json"
    step = make_step(stats_file=str(path))
    with caplog.at_level(logging.DEBUG, logger="sglang_eagle_overlap"):
        _unconstrained_step(step)
    assert step.telemetry.stats.steps == 1 and not path.exists()
    (msg,) = [r.getMessage() for r in caplog.records if "cannot write stats file" in r.getMessage()]
    assert msg.startswith(f"sglang-eagle-overlap: cannot write stats file {path}: ") and "No such file" in msg


@pytest.mark.parametrize("grammar_thread", [False, True])
def test_tree_links_with_a_middle_dimension_are_read_as_one_row_per_request(grammar_thread):
    """Links shaped ``[bs, 1, n]`` (the batch first, the nodes last) and a flat ``[bs * n]`` draft are read as
    ``[bs, n]`` rows, inline and on the grammar thread: the same mask as from ``[bs, n]`` links, and the drafts of
    request ``i`` are its row's ``n`` tokens."""
    from sglang_eo_dev.helpers.native import native

    matchers, nxt, sib, tok = _batch()
    bs, n = nxt.shape
    step = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=grammar_thread, native=native)
    try:
        pending = step.copy_tree(nxt.reshape(bs, 1, n), sib.reshape(bs, 1, n), tok.reshape(-1))
        job = step.start_build([MaskRequest(matcher=m) for m in matchers], pending, vocab_size=VOCAB)
        assert (job.future is not None) is grammar_thread
        out = step.finish_build(job, device=CPU)
    finally:
        step.close()
    assert out.tree.failed == [] and torch.equal(out.tree.bitmask, _reference_mask())


def test_every_request_whose_grammar_fails_is_counted(clock):
    """Two requests of one step fail: ``mask_failures`` counts requests (each is aborted), not steps."""
    matchers, nxt, sib, tok = _batch()
    reqs = [MaskRequest(grammar=BrokenGrammar(matchers[0], ok_fills=0), request_id="bad0"),
            MaskRequest(matcher=matchers[1]),
            MaskRequest(grammar=BrokenGrammar(matchers[2], ok_fills=0), request_id="bad2")]
    step = make_step(mask_time_limit_s=None)
    out = step.build_mask(reqs, PendingTree(host=(nxt, sib, tok)), vocab_size=VOCAB, device=CPU,
                          draft_device=tok.reshape(-1).clone())
    assert [i for i, _ in out.tree.failed] == [0, 2]
    assert step.telemetry.stats.counters["mask_failures"] == 2
