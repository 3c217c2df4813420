"""DEVELOPMENT ONLY: what the project's tests, benchmarks and demo share; never imported by the product.

* :mod:`sglang_eo_dev.cpu_runtime` -- lets the real SGLang engine run EAGLE + overlap + xgrammar on a CPU (an SGLang
  plugin of its own, entry point ``eo_cpu_runtime``), tiny local models, engine start helpers, stats probes.
* :mod:`sglang_eo_dev.helpers` -- tiny tokenizers, grammars and draft trees for core tests and benchmarks.
* :mod:`sglang_eo_dev.probes` -- scripts run in a fresh interpreter against an installed or patched SGLang.

Installed (editable) by ``scripts/setup_cpu_env.sh`` next to the plugin; importing it does nothing.
"""
