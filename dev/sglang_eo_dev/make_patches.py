"""Regenerate ``patches/sglang-<version>/*.patch`` from the installed SGLang (maintainers only).

``python -m sglang_eo_dev.make_patches`` with a venv's python (0.5.16 or 0.5.23) copies the files the patch touches
from the installed ``sglang`` into a scratch git repository, inserts the call sites below (each edit is anchored on
an exact upstream line and fails loudly if the anchor moved), and writes ``git format-patch`` output into the repo's
``patches/`` folder. The call sites only reach into ``sglang_eagle_overlap.adapters.v0_5_xx.band`` through the small
``speculative/grammar_overlap.py`` link module: the integration itself is never copied into SGLang.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[2]

LINK_MODULE = '''"""Link from this patched SGLang to the sglang-eagle-overlap package (``patches/sglang-{version}``).

The grammar-overlap integration lives in ``sglang_eagle_overlap.adapters.{band}.band`` (the package's plugin calls
the same functions through hooks). Without the package, or with ``SGLANG_EAGLE_OVERLAP=0``, ``runtime()`` is None
and SGLang keeps its own grammar path.
"""

try:
    from sglang_eagle_overlap.adapters.{band} import band
    from sglang_eagle_overlap.integration.runtime import for_patched_sglang
except ImportError:  # sglang-eagle-overlap is not installed
    band = None


def runtime():
    """The process's sglang-eagle-overlap runtime, or None (package missing or switched off)."""
    return None if band is None else for_patched_sglang()
'''

# file -> [(anchor, replacement)]; the anchor must occur exactly once in the upstream file.
Edit = Tuple[str, str]

EDITS: Dict[str, Dict[str, List[Edit]]] = {
    "0.5.16": {
        "sglang/srt/managers/scheduler.py": [
            ("from sglang.srt.speculative.dflash_utils import validate_dflash_request\n",
             "from sglang.srt.speculative import grammar_overlap\n"
             "from sglang.srt.speculative.dflash_utils import validate_dflash_request\n"),
            ("        # We do not support overlap + spec + grammar yet,\n"
             "        # so we need to turn off overlap for this batch.\n"
             "        # TODO(lsyin): support overlap + spec + grammar\n"
             "        need_grammar_sync = (\n"
             "            batch\n"
             "            and not batch.spec_algorithm.is_none()\n"
             "            and batch.has_grammar\n"
             "            and batch.forward_mode.is_decode()\n"
             "            and len(self.result_queue) > 0\n"
             "        )\n",
             "        # Spec + grammar decode needs the previous result processed first, unless\n"
             "        # sglang-eagle-overlap's verify advances it itself (EAGLE family, xgrammar).\n"
             "        rt = grammar_overlap.runtime()\n"
             "        need_grammar_sync = (\n"
             "            batch\n"
             "            and not batch.spec_algorithm.is_none()\n"
             "            and batch.has_grammar\n"
             "            and batch.forward_mode.is_decode()\n"
             "            and len(self.result_queue) > 0\n"
             "            and not (\n"
             "                rt is not None\n"
             "                and grammar_overlap.band.keeps_overlap(rt, batch, self.result_queue)\n"
             "            )\n"
             "        )\n"),
        ],
        "sglang/srt/speculative/eagle_worker_common.py": [
            ("from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput\n",
             "from sglang.srt.speculative import grammar_overlap\n"
             "from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput\n"),
            ("    verify_input: EagleVerifyInput = batch.spec_info\n"
             "    record_stream_for_v2_verify(batch, verify_input, fwd_stream)\n",
             "    verify_input: EagleVerifyInput = batch.spec_info\n"
             "    eo_rt = grammar_overlap.runtime()\n"
             "    # sglang-eagle-overlap: grammar-forced drafts, before the verify input is built; owns the step or not\n"
             "    eo_owned = eo_rt is not None and grammar_overlap.band.before_verify(eo_rt, batch, verify_input)\n"
             "    record_stream_for_v2_verify(batch, verify_input, fwd_stream)\n"),
            ("    ) = eagle_sample(verify_input, batch, logits_output, vocab_mask)\n",
             "    ) = eagle_sample(verify_input, batch, logits_output, vocab_mask)\n"
             "    if verify is not None:  # sglang-eagle-overlap: the accepted node's forced tokens, on the device\n"
             "        grammar_overlap.band.after_sample(eo_rt, batch, (predict, accept_lens, accept_index))\n"),
            ("    # Prepare grammar data on CPU if needed\n"
             "    if batch.has_grammar:\n",
             "    # sglang-eagle-overlap: async tree copy now, grammar work after the launch.\n"
             "    verify = grammar_overlap.band.begin_verify(eo_rt, batch, verify_input, owned=True) if eo_owned else None\n"
             "    # Prepare grammar data on CPU if needed\n"
             "    if batch.has_grammar and verify is None:\n"),
            ("    vocab_mask = None\n"
             "    if batch.has_grammar:\n"
             "        # Generate the logit mask for structured output.\n",
             "    vocab_mask = None\n"
             "    if verify is not None:\n"
             "        vocab_mask = grammar_overlap.band.build_vocab_mask(eo_rt, verify, verify_input, batch)\n"
             "    elif batch.has_grammar:\n"
             "        # Generate the logit mask for structured output.\n"),
        ],
        "sglang/srt/managers/scheduler_components/batch_result_processor.py": [
            ("from sglang.srt.speculative.base_spec_worker import BaseSpecWorker\n",
             "from sglang.srt.speculative import grammar_overlap\n"
             "from sglang.srt.speculative.base_spec_worker import BaseSpecWorker\n"),
            ("    def _apply_prefill_grammar(self, *, req: Req, next_token_id: int) -> None:\n",
             "    def _apply_prefill_grammar(self, *, req: Req, next_token_id: int) -> None:\n"
             "        rt = grammar_overlap.runtime()\n"
             "        if rt is not None and grammar_overlap.band.is_eagle_family(self.server_args):\n"
             "            return grammar_overlap.band.feed_prefill_token(rt, req, next_token_id)\n"),
            ("        if isinstance(tokens, int):\n"
             "            tokens = [tokens]\n"
             "        retained = []\n",
             "        rt = grammar_overlap.runtime()\n"
             "        if rt is not None and grammar_overlap.band.is_eagle_family(self.server_args):\n"
             "            return grammar_overlap.band.feed_tokens(rt, req, tokens)\n"
             "        if isinstance(tokens, int):\n"
             "            tokens = [tokens]\n"
             "        retained = []\n"),
        ],
    },
    "0.5.23": {
        "sglang/srt/speculative/spec_utils.py": [
            ("from sglang.srt.utils.nvtx_utils import profile_range\n",
             "from sglang.srt.utils.nvtx_utils import profile_range\n"
             "from sglang.srt.speculative import grammar_overlap\n"),
            ("def build_grammar_vocab_mask(\n",
             "if grammar_overlap.runtime() is not None:\n"
             "    # sglang-eagle-overlap: the tree host copy through reused pinned buffers.\n"
             "    GrammarTree = grammar_overlap.band.patched_grammar_tree(GrammarTree)\n"
             "\n"
             "\n"
             "def build_grammar_vocab_mask(\n"),
            ("    committed tokens, which the traversal then reads, so it has to run first.\n"
             "    \"\"\"\n"
             "    if barrier is not None:\n",
             "    committed tokens, which the traversal then reads, so it has to run first.\n"
             "    \"\"\"\n"
             "    rt = grammar_overlap.runtime()\n"
             "    if rt is not None and isinstance(tree, grammar_overlap.band.PluginGrammarTree):\n"
             "        # sglang-eagle-overlap: native tree mask, unmasked drafts neutralised.\n"
             "        return grammar_overlap.band.build_grammar_vocab_mask(\n"
             "            rt, reqs=reqs, tree=tree, sampling_info=sampling_info, device=device, barrier=barrier\n"
             "        )\n"
             "    if barrier is not None:\n"),
        ],
        "sglang/srt/speculative/eagle_worker_common.py": [
            ("    verify_input: EagleVerifyInput = batch.spec_info\n"
             "    record_stream_for_v2_verify(batch, verify_input, fwd_stream)\n",
             "    verify_input: EagleVerifyInput = batch.spec_info\n"
             "    from sglang.srt.speculative import grammar_overlap\n"
             "\n"
             "    eo_rt = grammar_overlap.runtime()\n"
             "    if eo_rt is not None:  # sglang-eagle-overlap: grammar-forced drafts, before the verify input is built\n"
             "        grammar_overlap.band.before_verify(eo_rt, batch, verify_input)\n"
             "    record_stream_for_v2_verify(batch, verify_input, fwd_stream)\n"),
            ("    # Must stay ahead of the target verify launch below.\n"
             "    grammar_tree = (\n",
             "    # Must stay ahead of the target verify launch below.\n"
             "    if eo_rt is not None:  # sglang-eagle-overlap: the grammar thread starts at the tree constructor\n"
             "        grammar_overlap.band.hand_over_verify(eo_rt, batch, grammar_barrier)\n"
             "    grammar_tree = (\n"),
            ("    fused_commit_outputs = predict.is_cuda and not batch.forward_mode.is_idle()\n",
             "    if eo_rt is not None:  # sglang-eagle-overlap: the accepted node's forced tokens, on the device\n"
             "        grammar_overlap.band.after_sample(eo_rt, batch, (predict, accept_lens, accept_index))\n"
             "    fused_commit_outputs = predict.is_cuda and not batch.forward_mode.is_idle()\n"),
        ],
        "sglang/srt/managers/scheduler_components/batch_result_processor.py": [
            ("from sglang.srt.speculative.base_spec_worker import BaseSpecWorker\n",
             "from sglang.srt.speculative import grammar_overlap\n"
             "from sglang.srt.speculative.base_spec_worker import BaseSpecWorker\n"),
            ("        if result.grammar_advanced or not batch.has_grammar:\n"
             "            return\n"
             "        is_decode = batch.forward_mode.is_decode()\n",
             "        rt = grammar_overlap.runtime()\n"
             "        if rt is not None:  # sglang-eagle-overlap: exactly once per (rid, output position)\n"
             "            return grammar_overlap.band.advance_grammar_fsm(rt, result, batch)\n"
             "        if result.grammar_advanced or not batch.has_grammar:\n"
             "            return\n"
             "        is_decode = batch.forward_mode.is_decode()\n"),
        ],
    },
}

SUBJECT = {
    "0.5.16": "Grammar overlap for EAGLE through sglang-eagle-overlap: call sites only",
    "0.5.23": "Grammar overlap through sglang-eagle-overlap: call sites only",
}
BODY = """Against SGLang {version} (installed-package layout, paths sglang/srt/...).

Adds the call sites of the sglang-eagle-overlap integration
(sglang_eagle_overlap.adapters.{band}.band, the same functions its plugin
reaches through hooks) and the link module speculative/grammar_overlap.py.
Without the sglang_eagle_overlap package every call site declines and
SGLang keeps its own path. Generated by `python -m sglang_eo_dev.make_patches`.
"""


def _git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout


def main() -> int:
    version = importlib.metadata.version("sglang")
    if version not in EDITS:
        raise SystemExit(f"no patch recipe for SGLang {version} (have: {', '.join(EDITS)})")
    band = "v" + version.replace(".", "_")
    site = Path(importlib.util.find_spec("sglang").origin).parents[1]
    with tempfile.TemporaryDirectory(prefix="eo-patch-") as tmp:
        root = Path(tmp)
        _git(root, "init", "-q")
        _git(root, "config", "user.name", "sglang-eagle-overlap")
        _git(root, "config", "user.email", "sglang-eagle-overlap@users.noreply.github.com")
        for rel in EDITS[version]:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, root / rel)
        _git(root, "add", "-A")
        _git(root, "commit", "-q", "-m", f"SGLang {version} (installed files)")
        for rel, edits in EDITS[version].items():
            path = root / rel
            text = path.read_text()
            for anchor, replacement in edits:
                if text.count(anchor) != 1:
                    raise SystemExit(f"{rel}: anchor found {text.count(anchor)} times (expected once):\n{anchor}")
                text = text.replace(anchor, replacement)
            path.write_text(text)
        link = root / "sglang/srt/speculative/grammar_overlap.py"
        link.write_text(LINK_MODULE.format(version=version, band=band))
        _git(root, "add", "-A")
        _git(root, "commit", "-q", "-m", SUBJECT[version], "-m", BODY.format(version=version, band=band))
        out = REPO / "patches" / f"sglang-{version}"
        for old in out.glob("*.patch"):
            old.unlink()
        out.mkdir(parents=True, exist_ok=True)
        _git(root, "format-patch", "-q", "--zero-commit", "-1", "-o", str(out), "HEAD")
    for p in sorted(out.glob("*.patch")):
        print(p.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
