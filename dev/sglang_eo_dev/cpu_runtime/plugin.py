"""TEST ONLY SGLang plugin: run the real engine's EAGLE3 + overlap scheduler + xgrammar path on a CPU without AMX.

Entry point ``sglang.srt.plugins: eo_cpu_runtime``; SGLang's ``load_plugins()`` calls :func:`load` in the engine/server
process and in the spawned scheduler. Installing it is harmless: nothing happens unless ``SGLANG_EO_CPU_RUNTIME=1``.

Every adjustment below is a workaround for running on CPU, not product behaviour:

* keep ``--attention-backend intel_amx`` on a CPU without AMX (SGLang silently swaps in ``torch_native``, which EAGLE
  refuses); the attention ops themselves come from the ``sgl_kernel`` stand-in of this distribution;
* keep the overlap scheduler with speculative decoding on CPU (SGLang turns it off on CPU);
* torch fallback for the Triton-only ``gather_spec_extras`` used by the overlap path;
* CPU ``apply_vocab_mask`` through ``xgrammar.apply_token_bitmask_inplace(backend="cpu")`` (0.5.16 raises
  "Unsupported device: cpu"; the 0.5.23 backend-level static variant raises too);
* 0.5.16 only: ``IntelAMXAttnBackend.forward_extend``/``forward_decode`` overwrite the sequence lengths they derived
  (verify prefix + draft, draft-decode per-branch lengths) with ``forward_batch.seq_lens``; ``overlap_utils`` calls
  ``record_stream`` on CPU tensors unguarded; NGRAM's JIT-built C++ corpus (``jit_kernel/csrc/ngram_corpus``) uses
  ``size_t`` without including ``<cstddef>`` (0.5.23's copy includes it), which this machine's g++ rejects;
* counters of the scheduler's overlap decisions for grammar decode batches and of SGLang's idle memory-leak checks,
  and the keys SGLang's grammar cache stores (:mod:`.stats`);
* tests only (``SGLANG_EO_FAULTS=1``): faults injected into the plugin's tree-mask build (:mod:`.faults`).
* tests only (``SGLANG_EO_SPEC_SAMPLING=1``): SGLang's sampling verify instead of its CPU greedy-only verify, and a
  deliberately biased verifier for marked requests (:mod:`.spec_sampling`);
* benchmarks only (``SGLANG_EAGLE_OVERLAP_TIMELINE_FILE``): overlap-timeline stamps (:mod:`.timeline_probe`).
* benchmarks only (``SGLANG_EO_STEP_TIMES_FILE``): per-decode-step wall and grammar time (:mod:`.step_times`).

Hook failures are only logged by SGLang's loader, so the scheduler records any target that did not land in the stats
file (``runtime_errors``) and the e2e tests assert it is empty.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

__all__ = ["load", "ENV_FLAG", "sglang_version"]

ENV_FLAG = "SGLANG_EO_CPU_RUNTIME"
logger = logging.getLogger(__name__)

_loaded = False
# target path -> human reason; checked in the scheduler process once hooks are applied.
_EXPECTED_TARGETS: dict[str, str] = {}


def sglang_version() -> tuple[int, ...]:
    from importlib.metadata import version

    parts = []
    for piece in version("sglang").split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def load() -> None:
    """Register the CPU-runtime hooks (idempotent; no-op unless ``SGLANG_EO_CPU_RUNTIME=1``)."""
    global _loaded
    if os.environ.get(ENV_FLAG) != "1" or _loaded:
        return
    _loaded = True

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_eo_dev.cpu_runtime import stats
    from sglang_eo_dev.cpu_runtime.torchvision_compat import define_torchvision_schemas, install_import_hook

    install_import_hook()
    define_torchvision_schemas()

    ver = sglang_version()

    def reg(target: str, hook: Callable[..., Any], kind: HookType, why: str) -> None:
        HookRegistry.register(target, hook, kind)
        _EXPECTED_TARGETS[target] = why

    _keep_intel_amx(ver)

    reg(
        "sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu",
        _keep_overlap_on_cpu,
        HookType.REPLACE,
        "keep the overlap scheduler with speculative decoding on CPU",
    )
    reg(
        "sglang.kernels.ops.speculative.gather_spec_extras.gather_spec_extras",
        _gather_spec_extras_torch,
        HookType.REPLACE,
        "torch fallback for the Triton-only gather_spec_extras",
    )
    reg(
        "sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask",
        _apply_vocab_mask_cpu,
        HookType.AROUND,
        "CPU vocab-mask application",
    )
    reg(
        "sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask",
        _apply_vocab_mask_cpu,
        HookType.AROUND,
        "CPU vocab-mask application (backend static method)",
    )
    reg(
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        _after_scheduler_init,
        HookType.AFTER,
        "hook self-check in the scheduler process",
    )
    if ver < (0, 5, 17):
        reg(
            "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.forward_extend",
            _extend_with_derived_seq_lens,
            HookType.AROUND,
            "0.5.16 verify seq-lens overwrite",
        )
        reg(
            "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.forward_decode",
            _decode_with_draft_seq_lens,
            HookType.AROUND,
            "0.5.16 draft-decode seq-lens overwrite",
        )
        reg("torch.Tensor.record_stream", _record_stream_skip_cpu, HookType.AROUND, "0.5.16 unguarded record_stream")
        reg("sglang.jit_kernel.utils.load_jit", _load_jit_with_cstddef, HookType.AROUND,
            "0.5.16 NGRAM corpus C++ missing <cstddef>")
    reg(
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_req_pool",
        stats.count_idle_memory_check,
        HookType.AFTER,
        "count SGLang's idle memory-leak checks (stats: idle_memory_checks)",
    )
    reg(
        "sglang.srt.managers.scheduler.Scheduler.abort_request",
        stats.record_abort_request,
        HookType.AFTER,
        "record the rids the scheduler is asked to abort (stats: abort_requests)",
    )
    reg(
        "sglang.srt.constrained.base_grammar_backend.BaseGrammarBackend.set_cache",
        stats.record_grammar_cache,
        HookType.AFTER,
        "record the keys SGLang's grammar cache stores (stats: grammar_cache)",
    )
    from sglang_eo_dev.cpu_runtime import ledger_probe

    reg(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
        ledger_probe.record_retraction,
        HookType.AFTER,
        "count the requests SGLang retracts when the KV pool is full (stats: retracted_*)",
    )
    from sglang_eo_dev.cpu_runtime import faults

    if os.environ.get(faults.ENV_FLAG) == "1":
        reg(faults.TARGET, faults.mask_request_for_around, HookType.AROUND, "fault injection (SGLANG_EO_FAULTS)")


# --- server-args adjustments (engine/server process) --------------------------------------------------------------


def _keep_intel_amx(ver: tuple[int, ...]) -> None:
    """Make SGLang's "no AMX -> torch_native" fallback see AMX, without telling the model layers (which would then
    call AMX-only weight-packing kernels). 0.5.23 reads the platform fact ``has_amx``, which only argument resolution
    consults; 0.5.16 calls ``cpu_has_amx_support`` from ``arg_groups/overrides.py``, so only that module's binding is
    replaced (a HookRegistry REPLACE would propagate to every module holding the function)."""
    try:
        from sglang.srt.runtime_context import get_platform

        get_platform()._install(has_amx=True)
        return
    except (ImportError, AttributeError):
        pass
    import sglang.srt.arg_groups.overrides as overrides

    if hasattr(overrides, "cpu_has_amx_support"):
        overrides.cpu_has_amx_support = lambda: True
    else:  # pragma: no cover - a future layout
        raise RuntimeError(
            f"sglang {'.'.join(map(str, ver))}: cannot keep intel_amx on a CPU without AMX (neither "
            "runtime_context.get_platform()._install nor arg_groups.overrides.cpu_has_amx_support exists); update "
            "dev/sglang_eo_dev/cpu_runtime/plugin.py"
        )


def _keep_overlap_on_cpu(server_args: Any) -> None:
    """Replacement for ``_disable_overlap_schedule_for_cpu``: leave ``disable_overlap_schedule`` as the user set it."""
    return None


# --- kernels -------------------------------------------------------------------------------------------------------


def _gather_spec_extras_torch(indices, topk_p_buf, topk_index_buf, output_tokens_buf, hidden_states_buf):
    idx = indices.reshape(-1).to("cpu" if indices.device.type == "cpu" else indices.device).long()
    hidden = hidden_states_buf[idx] if hidden_states_buf is not None else None
    return topk_p_buf[idx], topk_index_buf[idx], output_tokens_buf[idx], hidden


def _apply_vocab_mask_cpu(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    logits = kwargs.get("logits", args[-2] if len(args) >= 2 else None)
    vocab_mask = kwargs.get("vocab_mask", args[-1] if args else None)
    if logits is None or logits.device.type != "cpu":
        return original(*args, **kwargs)
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device), backend="cpu")
    return None


# --- 0.5.16 fixes --------------------------------------------------------------------------------------------------


class _swap_seq_lens:
    """Temporarily present ``seq_lens`` as ``forward_batch.seq_lens`` to a backend method that re-reads it."""

    def __init__(self, forward_batch: Any, seq_lens: Any) -> None:
        self.fb, self.seq_lens, self.saved = forward_batch, seq_lens, None

    def __enter__(self) -> None:
        self.saved = self.fb.seq_lens
        self.fb.seq_lens = self.seq_lens

    def __exit__(self, *exc: Any) -> None:
        self.fb.seq_lens = self.saved


def _extend_with_derived_seq_lens(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    meta = getattr(self, "extend_metadata", None)
    if meta is None or not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    with _swap_seq_lens(forward_batch, meta[0]):
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)


def _decode_with_draft_seq_lens(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    meta = getattr(self, "draft_decode_metadata", None)
    if meta is None:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    with _swap_seq_lens(forward_batch, meta[1]):
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)


def _load_jit_with_cstddef(original, *args, **kwargs):
    """Build the NGRAM corpus with ``-include cstddef`` (its ``result.h`` needs ``size_t``); other kernels unchanged."""
    if args and args[0] == "ngram_corpus":
        kwargs["extra_cflags"] = list(kwargs.get("extra_cflags") or []) + ["-include", "cstddef"]
    return original(*args, **kwargs)


def _record_stream_skip_cpu(original, tensor, *args, **kwargs):
    if tensor.device.type == "cpu":
        return None
    return original(tensor, *args, **kwargs)


# --- self-check ----------------------------------------------------------------------------------------------------


def _after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_eo_dev.cpu_runtime import stats

    missing = [f"{t} ({why})" for t, why in _EXPECTED_TARGETS.items() if t not in HookRegistry._patched]
    if missing:
        stats.record_error(
            f"sglang {'.'.join(map(str, sglang_version()))}: CPU-runtime hooks did not land: {missing}; the target "
            "moved or was renamed - update dev/sglang_eo_dev/cpu_runtime/plugin.py"
        )
    stats.mark_scheduler_started(scheduler)
    from sglang_eo_dev.cpu_runtime import timeline_probe

    timeline_probe.install(scheduler, sglang_version())  # no-op without SGLANG_EAGLE_OVERLAP_TIMELINE_FILE
    _count_final_overlap_decisions(scheduler)
    from sglang_eo_dev.cpu_runtime import ledger_probe

    ledger_probe.install(scheduler)  # retraction and ledger evidence for the constrained stress tests
    from sglang_eo_dev.cpu_runtime import step_times

    step_times.install(scheduler, sglang_version())  # no-op without SGLANG_EO_STEP_TIMES_FILE (benchmarks)
    from sglang_eo_dev.cpu_runtime import spec_sampling

    if os.environ.get(spec_sampling.ENV_FLAG) == "1":  # after every plugin's hooks: see spec_sampling.install
        spec_sampling.install()
    return None


def _count_final_overlap_decisions(scheduler: Any) -> None:
    """Count the scheduler's *final* overlap decision per batch.

    The counter must sit outside every plugin hook on ``Scheduler.is_disable_overlap_for_batch`` (the product
    plugin's AROUND hook changes the decision), and HookRegistry gives no ordering between plugins. By the time the
    scheduler is built all class-level hooks are applied, so wrapping the instance's bound method here makes the
    counter outermost. The scheduler loop calls ``self.is_disable_overlap_for_batch(...)``, so it reaches the wrapper.
    """
    from sglang_eo_dev.cpu_runtime import stats

    decide = scheduler.is_disable_overlap_for_batch

    def counted(batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = decide(batch, *args, **kwargs)
        stats.count_overlap_decision(result, scheduler, batch, *args, **kwargs)
        return result

    scheduler.is_disable_overlap_for_batch = counted
