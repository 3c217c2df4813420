"""TEST ONLY: SGLang's sampling verify on CPU, and a deliberately biased verifier to prove the distribution test bites.

Why: on CPU SGLang verifies greedily whatever the temperature (0.5.23 ``eagle_utils._verify_uses_greedy`` returns
True for ``is_cpu``; 0.5.16 ``eagle_sample`` tests ``_is_cpu`` inline) and has no CPU
``tree_speculative_sampling_target_only``. A speculative request at temperature 1 on the CPU engine therefore commits
the target's argmax after its first token: its output law is not the sampled one, and no distribution test can pass
or mean anything there. With ``SGLANG_EO_SPEC_SAMPLING=1`` (read in the scheduler by
:func:`sglang_eo_dev.cpu_runtime.plugin.load`) the CPU engine takes SGLang's own GPU sampling branch of
``eagle_sample`` instead, with the ``sgl_kernel`` stand-in's port of the sampling kernel
(:func:`sgl_kernel.tree_speculative_sampling_target_only`).

How: once the scheduler is built (every plugin's hooks applied), :func:`install` wraps ``eagle_utils.eagle_sample`` as
it then is (the product plugin's AROUND hook included) and rebinds every module's reference to it; the product plugin
holds that target in SGLang's ``HookRegistry``, which skips a second plugin's hook on a target already patched. For
the duration of a sampled (not all-greedy) call only:

* ``eagle_utils._is_cpu`` reads False, which sends that call into SGLang's sampling branch (0.5.23 passes it to
  ``_verify_uses_greedy``, 0.5.16 tests it inline); the module's other CPU branches (e.g. the ``QLEN_ONLY`` tree
  mask) run outside ``eagle_sample``;
* the sampling op is the stand-in's: 0.5.23 binds ``eagle_utils.tree_speculative_sampling_target_only`` at import
  (``None`` on CPU), 0.5.16 imports it from ``sgl_kernel`` inside the branch.

The biased verifier (``eo-biased-verify`` in a request's ``rid``): the mask multiplies the target's probabilities
after the softmax without renormalising them, in the accept test only. A draft token ``x`` the grammar allows is then
accepted with the unconstrained probability ``q(x)`` instead of ``q(x) / Z`` (``Z`` = the target's mass on the tokens
the grammar allows); on rejection the bonus token is drawn, as in the real op, from the masked target with the
rejected drafts removed (from the masked target itself when nothing is left, so outputs stay valid). Drafts the
target likes are under-accepted and never recovered: a wrong output law with valid outputs, the failure mode
constrained speculative sampling is known for. The same engine runs it, on the requests that ask for it; each biased
verify call is counted in the runtime stats (``biased_verify_rows``), each sampling verify call in
``sampling_verify_calls``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["BIAS_MARKER", "ENV_FLAG", "eagle_sample_around", "install"]

ENV_FLAG = "SGLANG_EO_SPEC_SAMPLING"
BIAS_MARKER = "eo-biased-verify"


@dataclasses.dataclass(frozen=True, slots=True)
class _BiasedCall:
    """What the biased sampler needs from the ``eagle_sample`` call it runs in."""

    rows: tuple[int, ...]  # batch rows whose request asked for the biased verifier
    raw_logits: Any  # (bs * draft_token_num, vocab) target logits before the grammar mask
    temperatures: Any  # (bs, 1)


def install() -> None:
    """Wrap ``eagle_utils.eagle_sample`` as the scheduler process has it now (call after every plugin's hooks are
    applied, e.g. from an AFTER hook of ``Scheduler.__init__``); idempotent."""
    import functools
    import sys
    import types

    import sglang.srt.speculative.eagle_utils as eu

    current = eu.eagle_sample
    if getattr(current, "_eo_spec_sampling", False):
        return
    wrapped = functools.wraps(current)(functools.partial(eagle_sample_around, current))
    wrapped._eo_spec_sampling = True  # type: ignore[attr-defined]
    for mod in list(sys.modules.values()):
        if isinstance(mod, types.ModuleType) and getattr(mod, "eagle_sample", None) is current:
            mod.eagle_sample = wrapped  # type: ignore[attr-defined]


def eagle_sample_around(original: Callable[..., Any], verify_input: Any, batch: Any, logits_output: Any,
                        *args: Any, **kwargs: Any) -> Any:
    """Run ``eagle_sample`` through SGLang's sampling branch (see the module docstring)."""
    import sgl_kernel
    import sglang.srt.speculative.eagle_utils as eu

    from sglang_eo_dev.cpu_runtime import stats

    sampling_info = getattr(batch, "sampling_info", None)
    if sampling_info is None or getattr(sampling_info, "is_all_greedy", True):
        return original(verify_input, batch, logits_output, *args, **kwargs)
    stats.count("sampling_verify_calls")
    rows = tuple(i for i, req in enumerate(getattr(batch, "reqs", None) or ())
                 if BIAS_MARKER in str(getattr(req, "rid", "")))
    biased = _BiasedCall(rows, logits_output.next_token_logits.detach().clone(),
                         sampling_info.temperatures.detach().clone()) if rows else None
    sampler: Callable[..., Any] = sgl_kernel.tree_speculative_sampling_target_only
    if biased is not None:
        stats.count("biased_verify_rows", len(rows))
        sampler = _biased_sampler(biased)
    saved_is_cpu = eu._is_cpu
    had_op = hasattr(eu, "tree_speculative_sampling_target_only")  # 0.5.23: bound at import (None on CPU)
    saved_op = getattr(eu, "tree_speculative_sampling_target_only", None)
    saved_kernel_op = sgl_kernel.tree_speculative_sampling_target_only  # 0.5.16 imports it inside the branch
    try:
        eu._is_cpu = False
        if had_op:
            eu.tree_speculative_sampling_target_only = sampler
        sgl_kernel.tree_speculative_sampling_target_only = sampler
        return original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        eu._is_cpu = saved_is_cpu
        if had_op:
            eu.tree_speculative_sampling_target_only = saved_op
        sgl_kernel.tree_speculative_sampling_target_only = saved_kernel_op


def _biased_sampler(call: _BiasedCall) -> Callable[..., Any]:
    """The sampling op with the biased accept test for ``call.rows`` (the other rows keep the real test)."""

    def sample(*, target_probs: Any, draft_probs: Any, threshold_single: float = 1.0, threshold_acc: float = 1.0,
               deterministic: bool = True, **kw: Any) -> None:
        import torch
        from sgl_kernel._spec_ops import _tree_sampling

        bs, d, vocab = target_probs.shape
        raw = call.raw_logits.reshape(bs, d, -1)[..., :vocab].to(torch.float32)
        accept = target_probs.clone()
        for r in call.rows:
            unconstrained = torch.softmax(raw[r] / call.temperatures[r].to(torch.float32), dim=-1)
            accept[r] = unconstrained * (target_probs[r] > 0)  # masked after the softmax, never renormalised
        _tree_sampling(**kw, target_probs=target_probs, draft_probs=draft_probs,
                       threshold_single=float(threshold_single), threshold_acc=float(threshold_acc),
                       accept_probs=accept, resample_empty_residual=True)

    return sample
