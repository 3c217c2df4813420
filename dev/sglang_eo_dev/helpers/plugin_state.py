"""Test-side handles on the plugin's process state: switch an activated runtime back to pass-through, feed one
request's run the way the product's barrier and post-processing do (``requests.ledger_run`` with SGLang's
``XGrammarGrammar`` record kept), returning the raw ledger outcome a test can compare, and run a band's barrier loop on
its own, counting the tokens it fed."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Tuple

from sglang_eagle_overlap.core.ledger import FeedOutcome
from sglang_eagle_overlap.core.step import GrammarStep
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.band import Band
from sglang_eagle_overlap.integration.requests import ledger_run, record_on_xgrammar

__all__ = ["deactivate", "feed_request", "feed_results"]


def deactivate() -> None:
    """Back to pass-through: this process's runtime (if any) is switched off; ``BandAdapter.activate`` switches it on
    again."""
    rt = runtime.current()
    if rt is not None:
        rt.active = False


def feed_request(step: GrammarStep, req: Any, start: int, tokens: Sequence[int]) -> FeedOutcome:
    """``req``'s run ``tokens`` at output position ``start`` through ``step``'s ledger, exactly once (a replay when
    it was fed already), as the bands feed it: through the bare xgrammar matcher for SGLang's ``XGrammarGrammar``."""
    return step.feed((ledger_run(req, start, tokens),), record_on_xgrammar)[0]


def feed_results(band: Band, results: Optional[Iterable[Tuple[Any, Any]]], current_reqs: Sequence[Any] = ()) -> int:
    """``band.feed_results`` of ``results`` on their own (not as a build's barrier: fed at once, the ledger bounded
    after). Returns the tokens fed by this call (replays feed nothing)."""
    fed_before = band.step.tokens_fed
    band.feed_results(results, current_reqs)
    return band.step.tokens_fed - fed_before
