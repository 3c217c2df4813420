"""Deterministic tiny models for running the real SGLang engine on CPU (TEST ONLY).

Everything is built locally (no downloads) and cached under ``$SGLANG_EO_MODEL_CACHE`` (default
``<repo>/.cache/tiny-models``) in a directory whose name carries a hash of this file and the build parameters, so a
change to the builders rebuilds. Builds are written to a temporary directory and renamed into place, so concurrent
test runs never see half a model.

* :func:`build_tokenizer` - byte-level BPE trained with ``tokenizers`` on a generated corpus (JSON documents and
  English-ish sentences), saved as a ``PreTrainedTokenizerFast`` with a chat template and ``<|endoftext|>`` as eos.
  Large vocabularies (e.g. >= 100k for mask tests) are reached by padding the trained vocabulary with generated
  (never-merged, still decodable) byte-level tokens.
* :func:`build_random_pair` - Llama target (hidden 64, 4 layers, float32) + EAGLE3 draft (1 layer, own draft vocab
  with ``d2t``/``t2d``), random weights: drafts are almost never accepted, which exercises rejection paths.
* :func:`build_follower_pair` - weights set by hand so the target is a bigram machine: the argmax after token ``t`` is
  ``succ[t]``, where ``succ`` walks the tokenization of :data:`FOLLOWER_DOCUMENT` (a JSON document valid under
  :data:`FOLLOWER_SCHEMA`) and then emits eos. The draft predicts the same chain several steps ahead, so under the
  schema drafts are accepted (accept length well above 2).

How the follower works (hidden size ``H``): every token of the chain gets its own basis vector ("slot"), all other
tokens share a null slot. The target's attention and MLP outputs are zeroed, so its residual stream, and therefore
every EAGLE3 auxiliary hidden state, is the embedding of the current token; its lm_head maps slot(t) to succ[t]. The
draft's ``fc`` copies one auxiliary state, its MLP maps slot(t) to slot(succ[t]) (one step along the chain), and its
lm_head again maps slot(t) to succ[t]; since the draft's hidden output feeds its next step, each draft step moves one
token further along the chain.

* :func:`build_think_follower_models` - one "reasoning" chain (two thinking tokens, ``</think>``, a newline, then
  :data:`FOLLOWER_DOCUMENT`, then eos) written by several follower models, one per speculative algorithm: a Llama
  target, an EAGLE-2 draft (``LlamaForCausalLMEagle``), a small standalone Llama draft (``STANDALONE``), and an
  MTP-style model (``MiMoForCausalLM`` with one MTP layer in the same checkpoint, which SGLang loads as ``MiMoMTP``
  for ``--speculative-algorithm NEXTN``). NGRAM needs no draft model. The tokenizer has ``<think>`` / ``</think>`` as
  single (non-special) added tokens, so ``--reasoning-parser deepseek-r1`` finds the end-of-thinking token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "ModelPair",
    "FOLLOWER_DOCUMENT",
    "FOLLOWER_SCHEMA",
    "build_tokenizer",
    "build_random_pair",
    "build_follower_pair",
    "AlgorithmModels",
    "THINK_END",
    "build_think_follower_models",
    "think_follower_chain",
    "cache_root",
]

# Bump to force a rebuild of every cached artefact (the hash of this file also changes on any edit).
_BUILD_VERSION = 1
HIDDEN = 64
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The document the follower pair writes, and a schema it is valid under. Chosen so its tokenization (with the
# default tokenizer) has no repeated token, which a bigram machine needs; build_follower_pair checks that.
# It is written with json.dumps' default separators (", ", ": "), which is what xgrammar emits for a JSON schema
# with any_whitespace=False (SGLang's constrained_json_disable_any_whitespace); separator tokens repeat across keys,
# (the byte-level pre-tokenizer keeps ' "' apart), so the document has one key with a sentence as its value.
FOLLOWER_DOCUMENT: dict[str, Any] = {"title": "Green river under bright morning light"}
FOLLOWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string"}},
    "required": ["title"],
    "additionalProperties": False,
}


@dataclasses.dataclass(frozen=True)
class ModelPair:
    """Paths of a target model, its EAGLE3 draft, and facts the tests need."""

    target: str
    draft: str
    vocab_size: int
    eos_token_id: int
    chain: tuple[int, ...] = ()  # follower only: the token ids the target walks, ending with eos


def cache_root() -> Path:
    env = os.environ.get("SGLANG_EO_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / ".cache" / "tiny-models"


def _key(kind: str, **params: Any) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps({"kind": kind, "v": _BUILD_VERSION, **params}, sort_keys=True).encode())
    return f"{kind}-{h.hexdigest()[:12]}"


def _cached(key: str, build) -> Path:
    """Return ``cache_root()/key``, building it with ``build(tmp_dir)`` if absent (atomic rename into place)."""
    from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

    install_import_hook()  # transformers imports torchvision, whose CUDA wheel needs the schema shim on CPU torch
    root = cache_root()
    final = root / key
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race
            if not (final / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- corpus --------------------------------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had not are but were which be one "
    "you all she there their an been has more if will would when who so no out up into them can only other new some "
    "could time these two may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used take three city "
    "name age active country river mountain green blue red small large quick bright quiet river stone light house "
    "water music book garden morning evening winter summer north south east west value price count total status "
    "ready open closed true false null item list order user email phone address number text title score level"
).split()
_SYLLABLES = "ka lo mi ra ten vel sor an ith qua dre fin gal hom pet rus sil tor un war xen yel zo bra cle".split()
_WORDS = _WORDS + [
    "".join(random.Random(i).choice(_SYLLABLES) for _ in range(1 + i % 3)) for i in range(1500)
]
_KEYS = (
    "name age city active id title price count tags items user email score level status note value type kind "
    "country enabled size color date time url"
).split()


def _json_value(rng: random.Random, depth: int) -> Any:
    r = rng.random()
    if depth < 2 and r < 0.15:
        return {rng.choice(_KEYS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    if depth < 2 and r < 0.25:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.5:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3))).capitalize()
    if r < 0.75:
        return rng.randint(0, 2000) if rng.random() < 0.7 else round(rng.uniform(-100, 100), 2)
    if r < 0.9:
        return rng.random() < 0.5
    return None


def _corpus(seed: int, n_docs: int) -> Iterator[str]:
    rng = random.Random(seed)
    for i in range(n_docs):
        if i % 2 == 0:
            doc = {rng.choice(_KEYS): _json_value(rng, 0) for _ in range(rng.randint(1, 6))}
            compact = rng.random() < 0.2
            yield json.dumps(doc, separators=(",", ":") if compact else None)
        else:
            sentences = []
            for _ in range(rng.randint(1, 4)):
                words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
                sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
            yield " ".join(sentences)
    # Make sure the follower document itself is in the corpus so its tokens exist.
    for _ in range(50):
        yield follower_text()


# --- tokenizer -----------------------------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int = 4096, seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """Directory of a saved ``PreTrainedTokenizerFast`` with ``vocab_size`` tokens in total (specials included).

    ``extra_tokens`` are added as single, non-special tokens (decoded into the text, matched whole by ``encode``) on
    top of a BPE trained to ``vocab_size - len(extra_tokens)``, so the total stays ``vocab_size``.
    """

    def build(out: Path) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        base_size = vocab_size - len(extra_tokens)
        trainer = trainers.BpeTrainer(
            vocab_size=base_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        n_docs = 4000 if vocab_size <= 8192 else 20000
        tok.train_from_iterator(_corpus(seed, n_docs), trainer=trainer)
        if tok.get_vocab_size() < base_size:
            tok = _pad_vocab(tok, base_size, seed)
        if extra_tokens:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token=EOS,
            pad_token="<|pad|>",
            bos_token=None,
            unk_token=None,
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.model_max_length = 2048
        fast.save_pretrained(str(out))

    extra = {"extra_tokens": list(extra_tokens)} if extra_tokens else {}
    return _cached(_key("tokenizer", vocab_size=vocab_size, seed=seed, **extra), build)


def _pad_vocab(tok, vocab_size: int, seed: int):
    """Append generated byte-level tokens (reachable by no merge) until the vocabulary has ``vocab_size`` entries."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    used = set(vocab) | {t["content"] for t in spec.get("added_tokens", [])}
    next_id = max(max(vocab.values()), max((t["id"] for t in spec.get("added_tokens", [])), default=0)) + 1
    rng = random.Random(seed + 1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while next_id < vocab_size:
        piece = ("\u0120" if rng.random() < 0.5 else "") + "".join(
            rng.choice(letters) for _ in range(rng.randint(4, 9))
        )
        if piece in used:
            continue
        used.add(piece)
        vocab[piece] = next_id
        next_id += 1
    return Tokenizer.from_str(json.dumps(spec))


# --- models --------------------------------------------------------------------------------------------------------


def _llama_config(vocab_size: int, eos_id: int, pad_id: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )


def _save_target(out: Path, tok_dir: Path, config, state: dict | None, seed: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    if state is not None:
        with torch.no_grad():
            for name, value in state.items():
                model.get_parameter(name).copy_(value)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, out / f.name)


def _save_draft(out: Path, tok_dir: Path, vocab_size: int, draft_vocab: int, eos_id: int, pad_id: int,
                tensors: dict, aux_layer_ids: list[int]) -> None:
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HIDDEN // 4,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": HIDDEN,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for f in tok_dir.iterdir():
        if f.is_file() and not f.name.startswith(".") and f.name != "config.json":
            shutil.copy(f, out / f.name)


def _draft_tensors(gen, vocab_size: int, draft_vocab: int, hot: "list[int]", std: float = 0.02) -> dict:
    import torch

    H, I = HIDDEN, 2 * HIDDEN
    kv = 2 * (HIDDEN // 4)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * std

    hot_t = torch.tensor(hot, dtype=torch.int64)
    d2t = hot_t - torch.arange(draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot_t] = True
    return {
        "fc.weight": rnd(H, 3 * H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": rnd(H, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, H),
        "midlayer.mlp.gate_proj.weight": rnd(I, H),
        "midlayer.mlp.up_proj.weight": rnd(I, H),
        "midlayer.mlp.down_proj.weight": rnd(H, I),
        "norm.weight": torch.ones(H),
        "lm_head.weight": rnd(draft_vocab, H),
        "d2t": d2t,
        "t2d": t2d,
    }


def _special_ids(tok_dir: Path) -> tuple[int, int, int]:
    from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

    install_import_hook()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    return len(tok), tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids("<|pad|>")


def build_random_pair(vocab_size: int = 4096, seed: int = 0, num_layers: int = 4) -> ModelPair:
    """Random-weight target + EAGLE3 draft sharing a locally trained tokenizer."""
    tok_dir = build_tokenizer(vocab_size, seed)
    n_vocab, eos_id, pad_id = _special_ids(tok_dir)
    draft_vocab = max(64, n_vocab // 2)

    def build(out: Path) -> None:
        import torch

        config = _llama_config(n_vocab, eos_id, pad_id, num_layers)
        _save_target(out / "target", tok_dir, config, None, seed)
        gen = torch.Generator().manual_seed(seed + 7)
        # Hot tokens: the first draft_vocab ids (specials + most frequent merges come first in a BPE vocab).
        hot = list(range(draft_vocab))
        _save_draft(out / "draft", tok_dir, n_vocab, draft_vocab, eos_id, pad_id,
                    _draft_tensors(gen, n_vocab, draft_vocab, hot), [0, num_layers // 2 - 1, num_layers - 2])

    root = _cached(_key("random-pair", vocab_size=vocab_size, seed=seed, layers=num_layers), build)
    return ModelPair(str(root / "target"), str(root / "draft"), n_vocab, eos_id)


def follower_text() -> str:
    """The exact text the follower pair generates (before eos)."""
    return json.dumps(FOLLOWER_DOCUMENT)


def follower_chain(tok_dir: Path) -> list[int]:
    """Token ids of the compact follower document, checked to have no repeated token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    text = follower_text()
    ids = tok.encode(text, add_special_tokens=False)
    if len(set(ids)) != len(ids):
        raise RuntimeError(
            f"follower document {text!r} tokenizes with a repeated token ({tok.convert_ids_to_tokens(ids)}); a "
            "bigram follower cannot write it - change FOLLOWER_DOCUMENT"
        )
    if len(ids) + 2 > HIDDEN:
        raise RuntimeError(f"follower document has {len(ids)} tokens; at most {HIDDEN - 2} fit the hidden size")
    return ids


def build_follower_pair(vocab_size: int = 4096, seed: int = 0, num_layers: int = 4, noise: float = 0.0) -> ModelPair:
    """Hand-set target + EAGLE3 draft that write :data:`FOLLOWER_DOCUMENT` then eos (see the module docstring).

    ``noise > 0`` gives the target's attention and MLP outputs random weights of that standard deviation instead of
    zeros: the target then usually, but not always, follows the chain, and where it deviates its choice depends on
    the whole context (KV cache). Drafts are still often accepted, so comparing such a pair's speculative output with
    its non-speculative output checks the accept paths (KV bookkeeping after multi-token acceptance), which the
    random pair, whose drafts are almost never accepted, cannot.
    """
    tok_dir = build_tokenizer(vocab_size, seed)
    n_vocab, eos_id, pad_id = _special_ids(tok_dir)
    chain = follower_chain(tok_dir) + [eos_id]

    def build(out: Path) -> None:
        import torch
        import torch.nn.functional as F

        H = HIDDEN
        null_slot = H - 1
        slot = {t: i for i, t in enumerate(chain)}  # chain tokens (and eos) get slots 0..len-1
        succ = {chain[i]: chain[i + 1] for i in range(len(chain) - 1)}
        first = chain[0]

        def code(t: int) -> torch.Tensor:
            v = torch.zeros(H)
            v[slot.get(t, null_slot)] = 1.0
            return v

        embed = torch.stack([code(t) for t in range(n_vocab)])
        # lm_head: row u = sum of the codes of every state whose successor is u (null -> first chain token).
        head = torch.zeros(n_vocab, H)
        for t, u in succ.items():
            head[u, slot[t]] = 1.0
        head[first, null_slot] = 1.0

        config = _llama_config(n_vocab, eos_id, pad_id, num_layers)
        state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
        noise_gen = torch.Generator().manual_seed(seed + 13)
        for i in range(num_layers):
            state[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.randn(H, H, generator=noise_gen) * noise
            state[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(H, 2 * H, generator=noise_gen) * noise
        _save_target(out / "target", tok_dir, config, state, seed)

        # Draft: fc copies the first aux state; the MLP steps slot(t) -> slot(succ t); lm_head as the target's.
        gen = torch.Generator().manual_seed(seed + 11)
        tensors = _draft_tensors(gen, n_vocab, n_vocab, list(range(n_vocab)))
        fc = torch.zeros(H, 3 * H)
        fc[:, :H] = torch.eye(H)
        tensors["fc.weight"] = fc
        tensors["midlayer.self_attn.o_proj.weight"] = torch.zeros(H, H)
        # RMSNorm(one-hot) = sqrt(H) * one-hot; gate/up rows pick slot j, so the product at slot k is p.
        amp = (1.0 / (1.0 / H + 1e-6)) ** 0.5
        p = float(F.silu(torch.tensor(amp)) * amp)
        gate = torch.zeros(2 * H, H)
        up = torch.zeros(2 * H, H)
        gate[:H] = torch.eye(H)
        up[:H] = torch.eye(H)
        down = torch.zeros(H, 2 * H)
        for t, u in succ.items():
            k = slot[t]
            down[:, k] = (code(u) - code(t)) / p
        down[:, null_slot] = (code(first) - torch.eye(H)[null_slot]) / p
        tensors["midlayer.mlp.gate_proj.weight"] = gate
        tensors["midlayer.mlp.up_proj.weight"] = up
        tensors["midlayer.mlp.down_proj.weight"] = down
        tensors["lm_head.weight"] = head.clone()
        _save_draft(out / "draft", tok_dir, n_vocab, n_vocab, eos_id, pad_id, tensors,
                    [0, num_layers // 2 - 1, num_layers - 2])

    root = _cached(_key("follower-pair", vocab_size=vocab_size, seed=seed, layers=num_layers, noise=noise), build)
    return ModelPair(str(root / "target"), str(root / "draft"), n_vocab, eos_id, tuple(chain))


# --- one reasoning chain, one follower model per speculative algorithm ---------------------------------------------

THINK_START = "<think>"
THINK_END = "</think>"
# Two-token thinking texts tried in order; the first that tokenizes to exactly two tokens sharing none with the rest of
# the chain is used, so ``</think>`` is always output token 2: the second draft of the first verify window (topk 1,
# 3 steps), i.e. accepted in the middle of a draft window with a draft after it.
_THINK_TEXTS = ("Let me", "I see", "So then", "Okay now", "Well then", "We can")


@dataclasses.dataclass(frozen=True)
class AlgorithmModels:
    """The think-follower models (see :func:`build_think_follower_models`); paths are model directories."""

    target: str  # LlamaForCausalLM follower (EAGLE, STANDALONE and NGRAM target)
    eagle_draft: str  # LlamaForCausalLMEagle (EAGLE-2) draft of ``target``
    standalone_draft: str  # small LlamaForCausalLM follower, a STANDALONE draft of ``target``
    mtp_target: str  # MiMoForCausalLM + one MTP layer in the same checkpoint (NEXTN: draft path = this path)
    vocab_size: int
    eos_token_id: int
    think_end_id: int
    chain: tuple[int, ...]  # the token ids every model here writes after a prompt, ending with eos
    think_end_index: int  # position of </think> in ``chain``


def think_follower_chain(tok_dir: Path) -> tuple[list[int], int]:
    """``(chain, index of </think>)``: 2 thinking tokens, ``</think>``, ``\\n``, the follower document (no eos).

    Every token in the chain is distinct (a bigram follower needs that); the newline right after ``</think>`` is there
    so that a grammar applied one token late would let it through (JSON does not start with whitespace here).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    end_ids = tok.encode(THINK_END, add_special_tokens=False)
    if len(end_ids) != 1:
        raise RuntimeError(f"{THINK_END!r} must be one token, got {end_ids}")
    tail = tok.encode("\n", add_special_tokens=False) + tok.encode(follower_text(), add_special_tokens=False)
    for text in _THINK_TEXTS:
        think = tok.encode(text, add_special_tokens=False)
        chain = think + end_ids + tail
        if len(think) == 2 and len(set(chain)) == len(chain):
            if len(chain) + 2 > HIDDEN:
                raise RuntimeError(f"think-follower chain has {len(chain)} tokens; at most {HIDDEN - 2} fit")
            return chain, len(think)
    raise RuntimeError(f"no thinking text in {_THINK_TEXTS} tokenizes to 2 tokens distinct from {tail}")


def _follower_weights(chain: list[int], n_vocab: int, second: dict[int, int]):
    """(embedding, lm_head) of a bigram follower over ``chain`` (see the module docstring).

    ``second`` maps a state token to a token whose logit is 0.5 (the chain successor has 1.0): what greedy decoding
    picks when a grammar masks the successor out. Key -1 is the null slot (every token outside the chain).
    """
    import torch

    H = HIDDEN
    null_slot = H - 1
    slot = {t: i for i, t in enumerate(chain)}

    def code(t: int) -> torch.Tensor:
        v = torch.zeros(H)
        v[slot.get(t, null_slot)] = 1.0
        return v

    embed = torch.stack([code(t) for t in range(n_vocab)])
    head = torch.zeros(n_vocab, H)
    for i in range(len(chain) - 1):
        head[chain[i + 1], slot[chain[i]]] = 1.0
    head[chain[0], null_slot] = 1.0
    for state, alt in second.items():
        head[alt, null_slot if state == -1 else slot[state]] = 0.5
    return embed, head


def _copy_tokenizer(tok_dir: Path, out: Path) -> None:
    for f in tok_dir.iterdir():
        if f.is_file() and not f.name.startswith(".") and f.name != "config.json":
            shutil.copy(f, out / f.name)


def _save_eagle2_draft(out: Path, tok_dir: Path, n_vocab: int, eos_id: int, pad_id: int, embed, seed: int) -> None:
    """``LlamaForCausalLMEagle`` (EAGLE-2): ``fc`` keeps only the token embedding of cat(embedding, target hidden), the
    layer adds nothing (zero ``o_proj`` / ``down_proj``), and SGLang gives the draft the target's lm_head, so the
    draft predicts succ[token] at every step."""
    import torch
    from safetensors.torch import save_file

    H, I, kv = HIDDEN, 2 * HIDDEN, 2 * (HIDDEN // 4)
    gen = torch.Generator().manual_seed(seed + 17)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    fc = torch.zeros(H, 2 * H)
    fc[:, :H] = torch.eye(H)
    tensors = {
        "embed_tokens.weight": embed,
        "fc.weight": fc,
        "fc.bias": torch.zeros(H),
        "layers.0.self_attn.q_proj.weight": rnd(H, H),
        "layers.0.self_attn.k_proj.weight": rnd(kv, H),
        "layers.0.self_attn.v_proj.weight": rnd(kv, H),
        "layers.0.self_attn.o_proj.weight": torch.zeros(H, H),
        "layers.0.post_attention_layernorm.weight": torch.ones(H),
        "layers.0.mlp.gate_proj.weight": rnd(I, H),
        "layers.0.mlp.up_proj.weight": rnd(I, H),
        "layers.0.mlp.down_proj.weight": torch.zeros(H, I),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": H // 4,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": n_vocab,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _copy_tokenizer(tok_dir, out)


def _save_mimo_mtp(out: Path, tok_dir: Path, n_vocab: int, eos_id: int, pad_id: int, embed, head, seed: int,
                   layers: int = 2) -> None:
    """``MiMoForCausalLM`` (Qwen2 layers) follower + one MTP layer (``model.mtp_layers.0.*``) in one checkpoint.

    The target's layers add nothing (zero ``o_proj`` / ``down_proj``), so its logits are lm_head(norm(embedding)):
    succ[token]. The MTP layer's ``input_proj`` keeps only the token half of cat(hidden_norm(h), token_norm(e)), its
    decoder block adds nothing, and it shares the target's embedding and lm_head, so it predicts succ[token] too.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    H, I, kv = HIDDEN, 2 * HIDDEN, 2 * (HIDDEN // 4)
    config = Qwen2Config(
        vocab_size=n_vocab, hidden_size=H, intermediate_size=I, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
        use_sliding_window=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"] = embed.clone()
    state["lm_head.weight"] = head.clone()
    for i in range(layers):
        state[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.zeros(H, H)
        state[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(H, I)
    gen = torch.Generator().manual_seed(seed + 19)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    proj = torch.zeros(H, 2 * H)
    proj[:, H:] = torch.eye(H)
    mtp = "model.mtp_layers.0."
    state.update({
        mtp + "token_layernorm.weight": torch.ones(H),
        mtp + "hidden_layernorm.weight": torch.ones(H),
        mtp + "input_proj.weight": proj,
        mtp + "final_layernorm.weight": torch.ones(H),
        mtp + "input_layernorm.weight": torch.ones(H),
        mtp + "post_attention_layernorm.weight": torch.ones(H),
        mtp + "self_attn.q_proj.weight": rnd(H, H),
        mtp + "self_attn.q_proj.bias": torch.zeros(H),
        mtp + "self_attn.k_proj.weight": rnd(kv, H),
        mtp + "self_attn.k_proj.bias": torch.zeros(kv),
        mtp + "self_attn.v_proj.weight": rnd(kv, H),
        mtp + "self_attn.v_proj.bias": torch.zeros(kv),
        mtp + "self_attn.o_proj.weight": torch.zeros(H, H),
        mtp + "mlp.gate_proj.weight": rnd(I, H),
        mtp + "mlp.up_proj.weight": rnd(I, H),
        mtp + "mlp.down_proj.weight": torch.zeros(H, I),
    })
    out.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(tok_dir, out)


def build_think_follower_models(vocab_size: int = 4096, seed: int = 0) -> AlgorithmModels:
    """Build (cached) every think-follower model; see :class:`AlgorithmModels` and the module docstring.

    Greedy behaviour of every target here: after any prompt it writes the chain (2 thinking tokens, ``</think>``,
    ``\\n``, :data:`FOLLOWER_DOCUMENT`, eos). Second choices (used when a grammar masks the successor out): after
    ``</think>`` and after a token outside the chain, the document's first token; so a JSON-schema request writes the
    document, and one with ``require_reasoning`` writes the thinking tokens, ``</think>``, then the document without the
    newline.
    """
    tok_dir = build_tokenizer(vocab_size, seed, extra_tokens=(THINK_START, THINK_END))
    n_vocab, eos_id, pad_id = _special_ids(tok_dir)
    chain_wo_eos, think_end_index = think_follower_chain(tok_dir)
    chain = chain_wo_eos + [eos_id]
    think_end_id = chain[think_end_index]
    doc_first = chain[think_end_index + 2]

    def build(out: Path) -> None:
        embed, head = _follower_weights(chain, n_vocab, {think_end_id: doc_first, -1: doc_first})
        state = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
        import torch

        for layers, name in ((4, "target"), (2, "standalone")):
            st = dict(state)
            for i in range(layers):
                st[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
                st[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
            _save_target(out / name, tok_dir, _llama_config(n_vocab, eos_id, pad_id, layers), st, seed)
        _save_eagle2_draft(out / "eagle2", tok_dir, n_vocab, eos_id, pad_id, embed, seed)
        _save_mimo_mtp(out / "mimo-mtp", tok_dir, n_vocab, eos_id, pad_id, embed, head, seed)

    root = _cached(_key("think-follower", vocab_size=vocab_size, seed=seed), build)
    return AlgorithmModels(
        target=str(root / "target"), eagle_draft=str(root / "eagle2"), standalone_draft=str(root / "standalone"),
        mtp_target=str(root / "mimo-mtp"), vocab_size=n_vocab, eos_token_id=eos_id, think_end_id=think_end_id,
        chain=tuple(chain), think_end_index=think_end_index,
    )
