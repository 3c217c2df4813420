"""What every SGLang band shares between the core and SGLang's objects, by concern:

* :mod:`.runtime` -- the one per-process object (settings + the core :class:`~sglang_eagle_overlap.core.GrammarStep`);
* :mod:`.band` -- :class:`~.band.Band`, the flow both bands share (in-flight step, mask build, barrier loop);
* :mod:`.requests` -- SGLang ``Req`` -> core inputs, and the per-request outcomes back (kept tokens, aborts);
* :mod:`.hooks` -- ``HookRegistry`` bookkeeping: declare, register, verify that every hook landed.

Imports no SGLang at module level; SGLang objects are reached through duck typing or lazy imports.
"""
