"""The test session keeps its temporary files, and SGLang's, out of /tmp (tests/conftest.py).

SGLang names its ZMQ ipc sockets with ``tempfile.NamedTemporaryFile(delete=False)`` and never removes them; the
session's private ``TMPDIR`` (removed at the end) is what keeps them out of ``/tmp``. These checks run in the test
process and in a spawned child, the way SGLang's scheduler and ``launch_server`` processes are started.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile


def _named_tmp_in_child(queue) -> None:
    queue.put(tempfile.NamedTemporaryFile(delete=False).name)  # what SGLang's PortArgs does


def test_session_tmpdir_is_private_and_inherited(tmp_path):
    private = os.environ.get("TMPDIR", "")
    assert private and os.path.basename(private).startswith("sglang-eo-tests-"), private
    assert tempfile.gettempdir() == private
    assert str(tmp_path).startswith(private + os.sep)  # pytest's own tmp_path folders too
    # A child started with subprocess (launch_server) ...
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.NamedTemporaryFile(delete=False).name)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.dirname(child) == private
    # ... and one spawned by multiprocessing (SGLang's scheduler / detokenizer) put their files there.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_named_tmp_in_child, args=(queue,))
    proc.start()
    name = queue.get(timeout=60)
    proc.join(timeout=60)
    assert os.path.dirname(name) == private
