"""Run in a fresh interpreter by tests/adapters/test_feed_walk.py: loads the plugin into the installed SGLang (its
hooks applied by ``HookRegistry``, as in a server) and records "the walk" of each path a verify step's accepted tokens
take from SGLang to the core (docs/architecture.md).

The walk of a path: the Python frames on the scheduler thread from the SGLang function that hands the tokens over
(its frame included) to the core's entry that takes the run (``GrammarStep.feed_later``, ``feed`` or
``replay_whole``; that frame included), outermost first. A frame is SGLang's when its module is ``sglang`` or under
``sglang.``, the plugin's when under ``sglang_eagle_overlap``; a crossing is a pair of neighbouring frames of which one
is SGLang's and the other the plugin's. The core's entry is recorded by a stand-in that takes its place in the call
(one frame, as the entry itself) and then calls it.

Paths (each from a real SGLang function of the installed band, called with stand-ins for the objects it reads):

* 0.5.16 ``barrier``: ``EAGLEWorkerV2.verify`` -> hooked ``run_eagle_verify`` -> ... -> ``feed_later`` (grammar
  thread on, the default: the barrier runs inside ``start_build`` before the launch; SGLang's verify body, which
  follows, fails on the stand-ins and is not part of the walk);
* 0.5.16 ``post_replay`` / ``post_feed``: ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` -> hooked
  ``_accept_grammar_tokens`` -> ... -> ``replay_whole`` (a run the barrier fed) / ``feed`` (a run it did not);
* 0.5.23 ``barrier``: ``Scheduler._advance_pending_grammar`` -> hooked ``advance_grammar_fsm`` -> ... ->
  ``feed_later``;
* 0.5.23 ``post``: ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` -> the same hook -> ``feed_later``.

``python -m sglang_eo_dev.probes.feed_walk`` -> ``PROBE-JSON {"band": ..., "walks": {path: [frame, ...]}}``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections import deque
from types import FrameType, SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

VOCAB = 32000
_ENTRIES = ("feed_later", "feed", "replay_whole")

# path -> (the SGLang function that hands the tokens over: module, qualified name; the core entry to record)
_START: Dict[str, Tuple[str, str, str]] = {}
_walks: Dict[str, List[str]] = {}
_path: List[Optional[str]] = [None]


def _name(frame: FrameType) -> str:
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_qualname}"


def _walk(entry: str, frame: Optional[FrameType], start: Tuple[str, str]) -> List[str]:
    """``entry`` and the frames from ``frame`` outwards up to the ``start`` frame, outermost first."""
    out = [entry]
    while frame is not None:
        out.append(_name(frame))
        if (frame.f_globals.get("__name__"), frame.f_code.co_qualname) == start:
            return out[::-1]
        frame = frame.f_back
    raise RuntimeError(f"the walk from {entry} never met {start}: {out}")


def _record_entries() -> None:
    from sglang_eagle_overlap.core.step import GrammarStep

    for name in _ENTRIES:
        fn = getattr(GrammarStep, name)

        def entry(*args: Any, _fn: Callable[..., Any] = fn, _name_: str = name, **kwargs: Any) -> Any:
            path = _path[0]
            if path is not None and path not in _walks and _START[path][2] == _name_:
                module, qualname, _ = _START[path]
                _walks[path] = _walk(f"sglang_eagle_overlap.core.step:GrammarStep.{_name_}", sys._getframe(1),
                                     (module, qualname))
            return _fn(*args, **kwargs)

        setattr(GrammarStep, name, functools.wraps(fn)(entry))


def _run(path: str, start: Tuple[str, str, str], call: Callable[[], Any]) -> None:
    _START[path], _path[0] = start, path
    try:
        call()
    except Exception:  # noqa: BLE001  SGLang's code past the walk meets the stand-ins: only the walk is wanted
        pass
    finally:
        _path[0] = None


def _req(rid: str, prefix: List[int]) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_eo_dev.helpers.grammars import sglang_grammar

    req = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=4096))
    req.output_ids.extend(prefix)
    req.grammar = sglang_grammar("nested", VOCAB, list(prefix))
    return req


def _processor(**given: Any) -> Any:
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    fields = {f.name: None for f in dataclasses.fields(SchedulerBatchResultProcessor)}
    if "server_args" in fields:  # 0.5.16: the grammar hooks' gate reads it
        fields["server_args"] = SimpleNamespace(speculative_algorithm="EAGLE3")
    fields["model_worker"] = SimpleNamespace(on_verify_complete_cpu=lambda *args, **kwargs: None)
    fields.update(given)
    return SchedulerBatchResultProcessor(**fields)


def _docs(n: int) -> List[List[int]]:
    import random

    from sglang_eo_dev.helpers.grammars import doc_tokens

    return [list(doc_tokens("nested", random.Random(i), VOCAB)) for i in range(n)]


def band_0_5_16() -> None:
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_eagle_overlap.adapters.v0_5_16 import band
    from sglang_eagle_overlap.integration import runtime
    from sglang_eo_dev.helpers.devices import verify_result

    rt = runtime.active()
    assert rt is not None
    docs = _docs(4)
    reqs = [_req(f"w-{i}", doc[:2]) for i, doc in enumerate(docs[:2])]
    queue = deque([(SimpleNamespace(reqs=reqs, forward_mode=ForwardMode.DECODE),
                    verify_result([doc[2:4] for doc in docs[:2]], 4))])
    bs, n = len(reqs), 4
    nxt = torch.tensor([[1, 2, 3, -1]] * bs)
    sib = torch.full((bs, n), -1, dtype=torch.int64)
    spec = SimpleNamespace(retrieve_next_token=nxt, retrieve_next_sibling=sib,
                           draft_token=torch.tensor([d[2] for d in docs[:2] for _ in range(n)]), topk=1,
                           draft_probs=None)
    batch = SimpleNamespace(reqs=reqs, has_grammar=True, spec_algorithm=SpeculativeAlgorithm.EAGLE3,
                            forward_mode=ForwardMode.DECODE, spec_info=spec, seq_lens=torch.ones(bs),
                            sampling_info=SimpleNamespace(vocab_size=VOCAB, vocab_mask=None))
    band.keeps_overlap(rt, batch, queue)  # the scheduler's overlap decision records the loop's queue
    worker = SimpleNamespace(target_worker=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                             plan_stream=None, plan_stream_ctx=None, topk=1, speculative_num_steps=3,
                             speculative_num_draft_tokens=n, device="cpu")
    _run("barrier", ("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2.verify", "feed_later"),
         lambda: EAGLEWorkerV2.verify(worker, batch))
    queue.clear()

    post = ("sglang.srt.managers.scheduler_components.batch_result_processor",
            "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")
    fed = [_req("p-fed", docs[2][:2])]
    batch_fed = SimpleNamespace(reqs=fed, forward_mode=ForwardMode.DECODE, has_grammar=False)
    result_fed = verify_result([docs[2][2:4]], 4)
    band.band_of(rt).feed_results([(batch_fed, result_fed)])  # a barrier fed this run: post-processing replays it
    _run("post_replay", (*post, "replay_whole"), lambda: _processor()._resolve_spec_v2_tokens(result_fed, batch_fed))
    fresh = [_req("p-fresh", docs[3][:2])]
    batch_fresh = SimpleNamespace(reqs=fresh, forward_mode=ForwardMode.DECODE, has_grammar=False)
    result_fresh = verify_result([docs[3][2:4]], 4)
    _run("post_feed", (*post, "feed"),
         lambda: _processor()._resolve_spec_v2_tokens(result_fresh, batch_fresh))


def band_0_5_23() -> None:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_eo_dev.helpers.devices import verify_result

    docs = _docs(2)
    processor = _processor(metrics_reporter=SimpleNamespace(snapshot_spec_decode_metrics=lambda *args: None))
    reqs = [_req("b-0", docs[0][:2])]
    batch = SimpleNamespace(reqs=reqs, has_grammar=True, forward_mode=ForwardMode.DECODE)
    sched = SimpleNamespace(result_queue=[(batch, verify_result([docs[0][2:4]], 4))], batch_result_processor=processor)
    _run("barrier", ("sglang.srt.managers.scheduler", "Scheduler._advance_pending_grammar", "feed_later"),
         lambda: Scheduler._advance_pending_grammar(sched))

    reqs = [_req("p-0", docs[1][:2])]
    batch = SimpleNamespace(reqs=reqs, has_grammar=True, forward_mode=ForwardMode.DECODE)
    result = verify_result([docs[1][2:4]], 4)
    _run("post", ("sglang.srt.managers.scheduler_components.batch_result_processor",
                  "SchedulerBatchResultProcessor._resolve_spec_v2_tokens", "feed_later"),
         lambda: processor._resolve_spec_v2_tokens(result, batch))


def main() -> Dict[str, Any]:
    try:  # CPU test venv: let the CUDA-built torchvision import against CPU torch (test-only helper)
        from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

        install_import_hook()
    except Exception:  # noqa: BLE001
        pass
    import importlib

    from sglang_eagle_overlap import plugin

    version = plugin.sglang_version()
    for mod in ("sglang.srt.managers.scheduler", "sglang.srt.speculative.eagle_worker_v2",
                "sglang.srt.managers.scheduler_components.batch_result_processor"):
        importlib.import_module(mod)
    plugin.load()
    assert plugin.is_active(), "the plugin did not activate"
    _record_entries()
    (band_0_5_16 if version == "0.5.16" else band_0_5_23)()
    return {"band": version, "walks": _walks}


if __name__ == "__main__":
    print("PROBE-JSON " + json.dumps(main()))
