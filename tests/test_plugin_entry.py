"""The entry point: import has no side effects, env switch, version gate, idempotence, all-or-nothing activation."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import subprocess
import sys

import pytest

from sglang_eagle_overlap import SUPPORTED_SGLANG_VERSIONS


def _fresh_plugin():
    import sglang_eagle_overlap.plugin as plugin
    from sglang_eagle_overlap.integration import runtime

    runtime.reset()
    plugin = importlib.reload(plugin)
    return plugin


def test_import_has_no_side_effects():
    # A fresh interpreter: importing the package and the plugin module must not import SGLang or register hooks.
    code = (
        "import sys, sglang_eagle_overlap, sglang_eagle_overlap.plugin, sglang_eagle_overlap.core;"
        "print(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_entry_point_is_registered():
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "eagle_overlap"]
    assert len(eps) == 1 and eps[0].value == "sglang_eagle_overlap.plugin:load"


def test_env_switch_turns_plugin_off(monkeypatch):
    plugin = _fresh_plugin()
    monkeypatch.setenv("SGLANG_EAGLE_OVERLAP", "0")
    called = []
    monkeypatch.setattr("sglang_eagle_overlap.adapters.adapter_for", lambda v: called.append(v))
    plugin.load()
    assert not plugin.is_active()
    assert called == []  # not even the version gate ran


def test_unsupported_version_refuses_loudly(monkeypatch, caplog):
    plugin = _fresh_plugin()
    monkeypatch.delenv("SGLANG_EAGLE_OVERLAP", raising=False)
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.19")
    with pytest.raises(plugin.PluginLoadError) as err:
        plugin.load()
    msg = str(err.value)
    assert "0.5.19" in msg and all(v in msg for v in SUPPORTED_SGLANG_VERSIONS) and "SGLANG_EAGLE_OVERLAP=0" in msg
    assert any(r.levelname == "ERROR" and "0.5.19" in r.getMessage() for r in caplog.records)
    assert not plugin.is_active()
    # A second call in the same process repeats the refusal (cheaply) instead of silently succeeding.
    with pytest.raises(plugin.PluginLoadError):
        plugin.load()


def test_hook_that_did_not_land_keeps_plugin_passive(monkeypatch):
    plugin = _fresh_plugin()
    monkeypatch.delenv("SGLANG_EAGLE_OVERLAP", raising=False)

    class FakeAdapter:
        name = "fake"
        activated = False

        def register(self, registry):
            pass

        def verify(self):
            return ["sglang.srt.some.Target.method (not patched)"]

        def activate(self, rt):
            FakeAdapter.activated = True

    monkeypatch.setattr("sglang_eagle_overlap.adapters.adapter_for", lambda v: FakeAdapter())
    with pytest.raises(plugin.PluginLoadError, match="did not land"):
        plugin.load()
    assert not FakeAdapter.activated and not plugin.is_active()


def test_load_is_idempotent(monkeypatch):
    plugin = _fresh_plugin()
    monkeypatch.delenv("SGLANG_EAGLE_OVERLAP", raising=False)
    calls = []

    from sglang_eagle_overlap.integration.hooks import BandAdapter

    class CountingAdapter(BandAdapter):  # the adapter interface, its calls counted
        name = "counting"

        def register(self, registry):
            calls.append("register")

        def verify(self):
            return []

        def activate(self, rt):
            calls.append("activate")
            rt.active = True

    monkeypatch.setattr("sglang_eagle_overlap.adapters.adapter_for", lambda v: CountingAdapter())
    plugin.load()
    plugin.load()
    plugin.load()
    assert calls == ["register", "activate"] and plugin.is_active()


@pytest.mark.parametrize("var,value", [("SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS", "fast"),
                                       ("SGLANG_EAGLE_OVERLAP_MASK_THREADS", "0"),
                                       ("SGLANG_EAGLE_OVERLAP", "maybe")])
def test_bad_switch_refuses_loudly_naming_it(monkeypatch, caplog, var, value):
    plugin = _fresh_plugin()
    monkeypatch.setenv(var, value)
    with pytest.raises(plugin.PluginLoadError) as err:
        plugin.load()
    assert var in str(err.value) and repr(value) in str(err.value)
    assert any(r.levelname == "ERROR" and var in r.getMessage() for r in caplog.records)
    assert not plugin.is_active()


def test_settings_are_read_once_into_one_object():
    from sglang_eagle_overlap.settings import DEFAULT_FORCED_DRAFTS, Settings

    s = Settings.from_env({"SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS": "0", "SGLANG_EAGLE_OVERLAP_MASK_THREADS": "3",
                           "SGLANG_EAGLE_OVERLAP_STATS_FILE": "/x/stats.json", "SGLANG_EAGLE_OVERLAP": "off"})
    assert (s.enabled, s.mask_threads, s.mask_time_limit_s, s.stats_file) == (False, 3, None, "/x/stats.json")
    d = Settings.from_env({})
    assert d.enabled and d.mask_time_limit_s == pytest.approx(0.05) and d.log_interval_s == 30.0
    # on by default: it keeps the native grammar work off the scheduler thread
    assert d.grammar_thread is True and d.timeline_file is None
    assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD": "1"}).grammar_thread is True
    assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD": "0"}).grammar_thread is False
    with pytest.raises(ValueError, match="SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD"):
        Settings.from_env({"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD": "maybe"})
    # a batch of one runs inline by default (the H200's bs-1 cells); any minimum >= 1 can be set, 0 or text cannot
    assert d.grammar_thread_min_batch == 2
    assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH": "1"}).grammar_thread_min_batch == 1
    assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH": " 8 "}).grammar_thread_min_batch == 8
    for bad in ("0", "two", "1.5"):
        with pytest.raises(ValueError, match="SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH"):
            Settings.from_env({"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH": bad})
    # the default is the one the configuration table (settings.markdown_table) documents
    import sglang_eagle_overlap.settings as settings_mod

    table = settings_mod.markdown_table().splitlines()
    row = next(line for line in table if "SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS" in line)
    assert d.forced_drafts is DEFAULT_FORCED_DRAFTS is None and row.rstrip().endswith("| auto |")
    for raw, want in (("1", True), ("on", True), ("0", False), ("off", False), ("", None), (" ", None)):
        assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS": raw}).forced_drafts is want
    with pytest.raises(ValueError, match="SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS"):
        Settings.from_env({"SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS": "sometimes"})
    row = next(line for line in table if "SGLANG_EAGLE_OVERLAP_NATIVE" in line)
    assert d.native is None and row.rstrip().endswith("| auto |")
    for raw, want in (("1", True), ("0", False), ("", None)):
        assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_NATIVE": raw}).native is want
    with pytest.raises(ValueError, match="SGLANG_EAGLE_OVERLAP_NATIVE"):
        Settings.from_env({"SGLANG_EAGLE_OVERLAP_NATIVE": "fast"})
    # the mask's upload on a side stream: on by default, as documented; 0 puts it back on the verify's stream
    row = next(line for line in table if "SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM" in line)
    assert d.mask_upload_stream is True and row.rstrip().endswith("| `1` |")
    assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM": "0"}).mask_upload_stream is False
    with pytest.raises(ValueError, match="SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM"):
        Settings.from_env({"SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM": "side"})


def test_the_max_length_pattern_switch_and_its_measured_bounds():
    from sglang_eagle_overlap.settings import MAX_LENGTH_PATTERN_BOUNDS, Settings

    assert MAX_LENGTH_PATTERN_BOUNDS == {"0.2.7": 128}  # the measured table (docs/benchmarks.md); 0.2.1 gains nothing
    on = Settings.from_env({})
    assert on.max_length_pattern is True
    assert on.max_length_pattern_bound("0.2.7") == 128
    for other in ("0.2.1", "0.2.8", "0.3.0", None):  # only measured versions rewrite
        assert on.max_length_pattern_bound(other) is None, other
    off = Settings.from_env({"SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN": "0"})
    assert off.max_length_pattern is False and off.max_length_pattern_bound("0.2.7") is None
    assert Settings.from_env({"SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN": "on"}).max_length_pattern is True
    with pytest.raises(ValueError, match="SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN"):
        Settings.from_env({"SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN": "128"})


def test_the_runtime_takes_the_installed_xgrammars_bound(monkeypatch):
    from sglang_eagle_overlap.integration import runtime, schemas
    from sglang_eagle_overlap.settings import Settings

    for installed, switch, want in (("0.2.7", True, 128), ("0.2.7", False, None), ("0.2.1", True, None),
                                    (None, True, None)):
        monkeypatch.setattr(runtime, "installed_xgrammar", lambda v=installed: v)
        runtime.reset()
        try:
            settings = Settings(max_length_pattern=switch)
            assert runtime.create(settings).max_length_pattern_bound == want, (installed, switch)
            line = schemas.describe(settings, installed, hooked=True)
            assert ("maxLength <= 128" in line) is (want is not None), line
        finally:
            runtime.reset()
    # a band without the JSON-schema hook (SGLang 0.5.16) says the switch does nothing there
    assert "has no effect" in schemas.describe(Settings(), "0.2.7", hooked=False)


def test_the_runtime_loads_the_native_module_unless_switched_off():
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.settings import Settings

    for switch in (None, True, False):
        runtime.reset()
        try:
            step = runtime.create(Settings(native=switch)).step
            assert step.native is None  # nothing loads before the first mask build
            assert (step.builder.native is not None) is (switch is not False)
            assert step.ledger.native is step.builder.native
        finally:
            runtime.reset()


def test_the_runtime_uploads_the_mask_on_a_side_stream_exactly_when_switched_on():
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.settings import Settings

    for on in (True, False):
        runtime.reset()
        try:
            assert runtime.create(Settings(mask_upload_stream=on)).step.uploader.side_stream is on
        finally:
            runtime.reset()


def test_the_runtime_has_forced_drafts_exactly_when_switched_on():
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.settings import Settings

    for on in (True, False):
        runtime.reset()
        try:
            rt = runtime.create(Settings(forced_drafts=on))
            assert (rt.step.forced is not None) is on
            assert rt.step.telemetry.snapshot()["forced_drafts"] is on
        finally:
            runtime.reset()


def test_the_bonus_keys_and_the_tail_switch_reach_the_runtimes_forced_drafts():
    """The bonus-key count and the tail switch are parsed, documented with their defaults (3 keys; the tail drafted),
    and handed to the runtime's forced drafts; bad values are refused by name."""
    from sglang_eagle_overlap import settings as settings_mod
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.settings import Settings

    table = settings_mod.markdown_table().splitlines()
    d = Settings.from_env({})
    row = next(line for line in table if "SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS" in line)
    assert d.forced_bonus_keys == 3 and row.rstrip().endswith("| 3 |")
    row = next(line for line in table if "SGLANG_EAGLE_OVERLAP_FORCED_TAIL" in line)
    assert d.forced_tail is True and row.rstrip().endswith("| `1` |")
    for env, keys, tail in (({}, 3, True),
                            ({"SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS": "0"}, 0, True),
                            ({"SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS": " 5 ",
                              "SGLANG_EAGLE_OVERLAP_FORCED_TAIL": "0"}, 5, False)):
        runtime.reset()
        try:
            forced = runtime.create(Settings.from_env(env)).step.forced
            assert forced is not None and (forced.bonus_keys, forced.draft_tail) == (keys, tail), env
        finally:
            runtime.reset()
    for var, bad in (("SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS", "-1"), ("SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS", "3x"),
                     ("SGLANG_EAGLE_OVERLAP_FORCED_TAIL", "some")):
        with pytest.raises(ValueError, match=var):
            Settings.from_env({var: bad})


@pytest.mark.parametrize("switch,algorithm,want", [
    (None, "STANDALONE", True), (None, "EAGLE3", True), (None, "EAGLE", True), (None, "NGRAM", False),
    (None, "", False), (True, "NGRAM", True), (False, "EAGLE3", False),
])
def test_forced_drafts_auto_decide_at_the_first_verify_by_algorithm(switch, algorithm, want):
    """Unset ("auto"): on for the algorithms whose verify trees the plugin owns (EAGLE, EAGLE3, STANDALONE), decided
    once at the first verify (before its grammar job records anything) and kept; a set switch wins over the
    algorithm."""
    from types import SimpleNamespace

    from sglang_eagle_overlap.integration import drafts, runtime
    from sglang_eagle_overlap.settings import Settings

    assert Settings(forced_drafts=switch).forced_drafts_for(algorithm) is want
    runtime.reset()
    try:
        rt = runtime.create(Settings(forced_drafts=switch))
        batch = SimpleNamespace(spec_algorithm=SimpleNamespace(name=algorithm) if algorithm else None, reqs=[])
        drafts.before_verify(rt, batch, None, owned=False)  # a verify without the plugin's mask still decides
        assert (rt.step.forced is not None) is want
        assert rt.step.telemetry.snapshot()["forced_drafts"] is want
        other = SimpleNamespace(spec_algorithm=SimpleNamespace(name="NGRAM" if want else "EAGLE3"), reqs=[])
        drafts.before_verify(rt, other, None, owned=False)  # decided once: a later batch changes nothing
        assert (rt.step.forced is not None) is want
    finally:
        runtime.reset()


def test_patched_sglang_gets_no_hooks(monkeypatch, caplog):
    plugin = _fresh_plugin()
    monkeypatch.delenv("SGLANG_EAGLE_OVERLAP", raising=False)
    monkeypatch.setattr(plugin, "sglang_version", lambda: SUPPORTED_SGLANG_VERSIONS[0])
    monkeypatch.setattr(plugin, "_is_patched", lambda: True)
    registered = []

    class Adapter:
        name = "would-hook"

        def register(self, registry):
            registered.append(registry)

    monkeypatch.setattr("sglang_eagle_overlap.adapters.adapter_for", lambda v: Adapter())
    with caplog.at_level("INFO", logger="sglang_eagle_overlap"):
        plugin.load()
    assert registered == [] and not plugin.is_active()
    assert any("is patched" in r.getMessage() for r in caplog.records)
