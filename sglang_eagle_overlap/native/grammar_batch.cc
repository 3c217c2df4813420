// sglang-eagle-overlap: one native call per verify step for the batch's xgrammar work.
//
// Why: the grammar work of a constrained EAGLE step is a few native calls per request and per tree node (accept,
// rollback, is_terminated, fill). Made from Python, each one is a Python frame, an argument conversion and a GIL
// release and re-acquire inside tvm-ffi's call; at bs 64 that per-call overhead is most of the step's grammar time.
// Here the same calls are made from C++, for the whole batch, behind one Python call: the previous batch's accepted
// runs are fed to their matchers and this batch's tree mask is walked in the same call (StepBatch), each request's
// matcher touched by one thread, requests spread over the calling thread and persistent helper threads.
//
// How: xgrammar 0.2.x binds its GrammarMatcher as a tvm-ffi object type whose methods are registered by reflection
// ("xgrammar.tvm_ffi_binding.GrammarMatcher": accept_token, rollback, is_terminated, fill_next_token_bitmask). This
// file finds those methods through tvm-ffi's stable C ABI (reflection::GetMethod) and calls them as ffi::Function:
// it uses no xgrammar header and depends on no xgrammar ABI beyond the registered method signatures, which are
// checked when the methods are looked up. Built per environment against that environment's tvm-ffi headers
// (sglang_eagle_overlap/core/native.py), loaded with tvm_ffi.load_module; tvm-ffi releases the GIL for the call, and
// no thread of this file ever touches Python.
//
// The semantics are those of sglang_eagle_overlap/core/mask.py (the lockstep walk: _Walker), core/ledger.py
// (_feed_matcher) and core/forced.py (ForcedDrafts.record: the text each filled node's grammar forces), which stay the
// reference implementation and the fallback; tests compare the two bit for bit.

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/container/tuple.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/accessor.h>
#include <tvm/ffi/string.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

constexpr const char* kMatcherType = "xgrammar.tvm_ffi_binding.GrammarMatcher";

struct Methods {
  ffi::Function accept;      // (matcher, int token, bool debug) -> bool
  ffi::Function rollback;    // (matcher, int k) -> None
  ffi::Function terminated;  // (matcher) -> bool
  ffi::Function fill;        // (matcher, tensor bitmask, int row, bool debug) -> bool
  ffi::Function jump;        // (matcher) -> str: the text the grammar forces from the matcher's state
};

const Methods& M() {
  static const Methods m{
      ffi::reflection::GetMethod(kMatcherType, "accept_token"),
      ffi::reflection::GetMethod(kMatcherType, "rollback"),
      ffi::reflection::GetMethod(kMatcherType, "is_terminated"),
      ffi::reflection::GetMethod(kMatcherType, "fill_next_token_bitmask"),
      ffi::reflection::GetMethod(kMatcherType, "find_jump_forward_string"),
  };
  return m;
}

// One forced text found (forced.py: ForcedDrafts.record): the node ``row``'s own (``key`` -1), or the text forced after
// the bonus key ``key`` where the node's own is empty.
struct Forced {
  int64_t row, key;
  std::string text;
};

// Whether ``s`` is whole UTF-8 characters. A matcher in the middle of a multi-byte character forces the rest of its
// bytes first: no text a tokenizer can encode (and Python could not even hold it as a str).
bool WholeUtf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    }
    i += len;
  }
  return true;
}

// What the grammar forces after node ``row`` (the matcher in that node's state, which it is left in): its own text,
// or where that is empty the text after each of ``keys`` the grammar allows there (accept, ask, rollback 1), in key
// order. A text that is not whole UTF-8 characters is left out (the node's own: and no key is tried). Only for
// matchers whose grammar the caller admitted (a grammar whose forced text may never end is never asked).
void RecordForced(const Methods& m, const ffi::ObjectRef& matcher, int64_t row, const std::vector<int64_t>& keys,
                  std::vector<Forced>* out) {
  std::string own = std::string(m.jump(matcher).cast<ffi::String>());
  if (!own.empty()) {
    if (WholeUtf8(own)) out->push_back({row, -1, std::move(own)});
    return;
  }
  for (int64_t key : keys) {
    if (!m.accept(matcher, key, false).cast<bool>()) continue;
    std::string after;
    try {
      after = std::string(m.jump(matcher).cast<ffi::String>());
    } catch (...) {
      m.rollback(matcher, 1);
      throw;
    }
    m.rollback(matcher, 1);
    if (!after.empty() && WholeUtf8(after)) out->push_back({row, key, std::move(after)});
  }
}

template <typename T>
T* Data(const ffi::TensorView& t, const char* name, int64_t min_numel) {
  int64_t numel = 1;
  for (int i = 0; i < t.ndim(); ++i) numel *= t.shape()[i];
  if (numel < min_numel) {
    TVM_FFI_THROW(ValueError) << name << " has " << numel << " elements, needs >= " << min_numel;
  }
  if ((t.dtype().code != kDLInt && t.dtype().code != kDLUInt) || t.dtype().bits != sizeof(T) * 8 ||
      t.dtype().lanes != 1) {
    TVM_FFI_THROW(TypeError) << name << " must be a " << sizeof(T) * 8 << "-bit integer tensor";
  }
  if (t.device().device_type != kDLCPU) TVM_FFI_THROW(ValueError) << name << " must be a host tensor";
  int64_t expect = 1;  // row-major contiguous: the walk indexes rows as base * width
  for (int i = t.ndim() - 1; i >= 0; --i) {
    if (t.shape()[i] != 1 && t.stride(i) != expect) TVM_FFI_THROW(ValueError) << name << " must be contiguous";
    expect *= t.shape()[i];
  }
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

// A host integer tensor of any width as int64 values (the verify tree: a few hundred entries, copied once).
std::vector<int64_t> Int64s(const ffi::TensorView& t, const char* name, int64_t numel) {
  if (t.numel() != numel) TVM_FFI_THROW(ValueError) << name << " has " << t.numel() << " elements, expected " << numel;
  std::vector<int64_t> out(static_cast<size_t>(numel));
  DLDataType dt = t.dtype();
  if (dt.code == kDLInt && dt.bits == 64) {
    const int64_t* p = Data<const int64_t>(t, name, numel);
    std::copy(p, p + numel, out.begin());
  } else if (dt.code == kDLInt && dt.bits == 32) {
    const int32_t* p = Data<const int32_t>(t, name, numel);
    std::copy(p, p + numel, out.begin());
  } else {
    TVM_FFI_THROW(TypeError) << name << " must be an int32 or int64 tensor";
  }
  return out;
}

using Clock = std::chrono::steady_clock;

// Persistent helper threads, process-wide: a step's work is spread over the calling thread and up to ``extra``
// helpers without creating a thread per call (creating and joining one costs tens of microseconds, as much as a
// request's whole work). Run(extra, body) runs ``body`` on the caller and on every helper that picks it up before the
// caller has finished its own share; ``body`` hands out its items through its own atomics, so a helper that wakes late
// (its core busy) simply finds nothing left, and the caller never waits for a helper that has not started. Helpers
// are created on first use and never exit: the pool is leaked on purpose, so that no destructor runs while a helper
// waits at process exit. After a fork the child (which has none of the parent's threads) starts a pool of its own.
class Pool {
 public:
  static Pool& Get() {
    static std::mutex guard;
    static Pool* pool = nullptr;
    std::lock_guard<std::mutex> lock(guard);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new Pool();  // the parent's pool, if any, is abandoned
    return *pool;
  }

  void Run(int64_t extra, const std::function<void()>& body) {
    if (extra <= 0) {
      body();
      return;
    }
    std::lock_guard<std::mutex> one_at_a_time(run_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int64_t>(threads_) < extra) {
        std::thread(&Pool::Loop, this).detach();
        ++threads_;
      }
      body_ = &body;
      want_ = extra;
      ++generation_;
    }
    work_.notify_all();
    body();
    std::unique_lock<std::mutex> lock(mu_);
    want_ = 0;  // helpers that have not picked the body up by now skip it
    done_.wait(lock, [this] { return active_ == 0; });
    body_ = nullptr;
  }

 private:
  Pool() : pid_(getpid()) {}

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t seen = generation_;
    for (;;) {
      work_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (want_ <= 0 || body_ == nullptr) continue;
      --want_;
      ++active_;
      const std::function<void()>* body = body_;
      lock.unlock();
      try {
        (*body)();
      } catch (...) {  // bodies catch per item; nothing may escape a helper thread
      }
      lock.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }

  const pid_t pid_;
  std::mutex run_;  // one Run at a time
  std::mutex mu_;
  std::condition_variable work_;
  std::condition_variable done_;
  size_t threads_ = 0;
  uint64_t generation_ = 0;
  const std::function<void()>* body_ = nullptr;
  int64_t want_ = 0;    // helpers still wanted for the current body
  int64_t active_ = 0;  // helpers inside the current body
};

// One request's tree walk (mask.py's _Walker, without its pauses): DFS in the order of the Python walk, filling the
// row of every valid, non-terminating node after the root (whose row the caller filled). Returns the valid nodes
// walked; sets *done to false if the deadline passed first (then the request's non-root rows are all-allowed again).
// The matcher is always left in its entry state, also when a method throws (the exception then propagates).
// With ``forced``, every filled row's forced texts go to ``forced`` (RecordForced).
int64_t WalkOne(const Methods& m, const ffi::ObjectRef& matcher, const int64_t* nxt, const int64_t* sib,
                const int64_t* tok, int64_t n, int64_t base, int64_t vocab, int32_t* mask, int64_t width,
                const ffi::TensorView& mask_view, uint8_t* written, bool has_deadline, Clock::time_point deadline,
                bool* done, const std::vector<int64_t>& keys, std::vector<Forced>* forced) {
  struct Frame {
    int64_t node, parent, pdepth;
  };
  std::vector<Frame> stack;
  stack.reserve(static_cast<size_t>(n));
  if (nxt[0] >= 0) stack.push_back({nxt[0], 0, 0});
  int64_t depth = 0;
  int64_t valid = 0;
  *done = true;
  try {
    while (!stack.empty()) {
      Frame f = stack.back();
      stack.pop_back();
      int64_t s = sib[f.node];
      if (s >= 0) stack.push_back({s, f.parent, f.pdepth});
      int64_t t = tok[f.node];
      if (t < 0 || t >= vocab) continue;
      uint32_t word = static_cast<uint32_t>(mask[(base + f.parent) * width + (t >> 5)]);
      if (!((word >> (t & 31)) & 1u)) continue;
      if (has_deadline && Clock::now() > deadline) {
        *done = false;
        break;
      }
      if (depth > f.pdepth) {
        m.rollback(matcher, depth - f.pdepth);
        depth = f.pdepth;
      }
      if (!m.accept(matcher, t, false).cast<bool>()) continue;
      depth = f.pdepth + 1;
      if (m.terminated(matcher).cast<bool>()) continue;  // terminating node: row stays all-allowed
      int64_t c = nxt[f.node];
      if (c >= 0) stack.push_back({c, f.node, depth});
      m.fill(matcher, mask_view, base + f.node, false);
      written[base + f.node] = 1;
      ++valid;
      if (forced != nullptr) RecordForced(m, matcher, base + f.node, keys, forced);
    }
    if (depth) m.rollback(matcher, depth);
  } catch (...) {
    if (depth) m.rollback(matcher, depth);
    throw;
  }
  if (!*done) {  // time limit: every non-root row back to all-allowed (mask.py: _Walker.abandon)
    for (int64_t r = base + 1; r < base + n; ++r) {
      for (int64_t w = 0; w < width; ++w) mask[r * width + w] = -1;
    }
  }
  return valid;
}

// Feed states (core/native.py: FED, TERMINATED, REJECTED, TERMINATED_BEFORE, FEED_ERROR, NOT_FED).
constexpr int64_t kFed = 0, kTerminated = 1, kRejected = 2, kTerminatedBefore = 3, kFeedError = 4, kNotFed = 5;
// Walk statuses (core/native.py: WALKED, WALK_TERMINATED, WALK_TIMED_OUT, WALK_FAILED).
constexpr int64_t kWalked = 0, kWalkTerminated = 1, kWalkTimedOut = 2, kWalkFailed = 3;

// One run fed to a matcher (ledger.py: _feed_matcher): ``live`` = the ledger's own last run left it not terminated, so
// no check before the run. Sets (tokens retained, state); an exception escapes with *kept tokens already consumed.
void FeedOne(const Methods& m, const ffi::ObjectRef& mt, bool live, const int64_t* tok, int64_t len, int64_t* kept,
             int64_t* state) {
  *kept = 0;
  *state = kFed;
  if (!live && m.terminated(mt).cast<bool>()) {
    *state = kTerminatedBefore;
    return;
  }
  for (int64_t i = 0; i < len; ++i) {
    if (!m.accept(mt, tok[i], false).cast<bool>()) {
      *state = (*kept == 0 && m.terminated(mt).cast<bool>()) ? kTerminatedBefore : kRejected;
      return;
    }
    ++*kept;
    if (m.terminated(mt).cast<bool>()) {
      *state = kTerminated;
      return;
    }
  }
}

std::string What(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown C++ exception";
  }
}

// The error messages of the last StepBatch call made by the calling thread: one slot per thread, so calls on two
// threads never see each other's messages. StepErrors must be called on the thread that made the call, before its
// next call (the Python side fetches them right after the call, on the same thread).
struct Errors {
  std::vector<std::string> messages;
};

Errors& LastErrors() {
  thread_local Errors errors;
  return errors;
}

// The forced texts of the last StepBatch call made by the calling thread (as LastErrors).
std::vector<std::string>& LastForced() {
  thread_local std::vector<std::string> texts;
  return texts;
}

// The batch's grammar work of one verify step, in one call:
//
// 1. feeds: run f (``feed_matchers[f]``) is fed as ledger.py's _feed_matcher feeds it; runs of one matcher in their
//    given order. ``feed_packed`` holds per run its live flag (the ledger's own last run left the matcher not
//    terminated: no check before the run), its source and then either its tokens (source -1: length, tokens) or its
//    row in a result (source s >= 0: the row; its tokens are ``source_ids[s][row * stride : row * stride + len]``
//    with ``len = source_lens[s][row]`` and ``stride = source_strides[s]``, or the one token ``source_ids[s][row]``
//    when ``source_lens[s]`` is empty: a prefill result). Results are read here, so their host copies must be done;
//    Python never has to turn them into lists on the thread that calls this;
// 2. mask (mask.py: TreeMaskBuilder._lockstep): for every walk request w (batch row ``walk_rows[w]``, matcher
//    ``walk_matchers[w]``, fed first if it has runs) that is not terminated, its root row is filled -- every root
//    before any walk, and no deadline applies to roots --, then its tree is walked (``nxt`` / ``sib`` ``[bs, n]``,
//    ``tok`` ``bs * n`` values) into ``mask`` (int32 ``[>= bs * n, width]``, every row this call may write holding
//    all-allowed or a stale fill the walk never reads). ``budget_s`` < 0: no time limit;
// 3. the sparse reset (mask.py: TreeMaskBuilder._settle): every row of ``reset_rows`` (rows of ``reset_t``, the whole
//    reusable buffer whose first rows ``mask`` views) that this call did not fill is set back to all-allowed.
//
// 4. forced texts (forced.py: ForcedDrafts.record), when ``forced_ok`` is not empty: for every walk request w with
//    ``forced_ok[w]`` set, every row it fills (root included) gets its forced texts (RecordForced, bonus keys
//    ``forced_keys``); StepForced() on the same thread returns them as text, their rows and keys come with the result.
//
// Each matcher is one item, handled by one thread from its first feed to the end of its walk; items are spread over
// ``threads`` threads (the caller's included). Arguments are checked before any matcher is touched. An exception
// inside an item stays in that item: a feed that raises is reported (kFeedError, with the tokens consumed before it),
// the item's later runs are kNotFed and its walk kWalkFailed; a walk that raises leaves its matcher in its entry
// state and is kWalkFailed (rows of a failed walk are left to the caller). Nothing is ever fed twice.
//
// Returns [valid nodes of the batch, rows reset, errors, T, R, W walk statuses, W valid-node counts, F x (retained
// tokens, feed state), F run lengths, the T tokens of all runs in run order (as read: packed or from their result),
// R x (row, key) of the forced texts found, the rows filled (any order)]; when errors > 0, StepErrors() on the same
// thread returns their messages ("f<index>: message" / "w<index>: message"), and when R > 0 StepForced() the R texts
// in the same order, until that thread's next call.
ffi::Shape StepBatch(
    ffi::Array<ffi::ObjectRef> feed_matchers, ffi::Array<int64_t> feed_packed, ffi::Array<ffi::Tensor> source_ids,
    ffi::Array<ffi::Tensor> source_lens, ffi::Array<int64_t> source_strides, ffi::Array<ffi::ObjectRef> walk_matchers,
    ffi::Array<int64_t> walk_rows, ffi::TensorView nxt_t, ffi::TensorView sib_t, ffi::TensorView tok_t,
    ffi::TensorView mask_t, int64_t vocab, double budget_s, int64_t threads, ffi::Array<int64_t> reset_rows,
    ffi::TensorView reset_t, ffi::Array<int64_t> forced_ok, ffi::Array<int64_t> forced_keys) {
  const Methods& m = M();
  // -- checks (nothing touched yet) --
  int64_t nf = static_cast<int64_t>(feed_matchers.size());
  int64_t nw = static_cast<int64_t>(walk_matchers.size());
  int64_t ns = static_cast<int64_t>(source_ids.size());
  if (static_cast<int64_t>(walk_rows.size()) != nw) TVM_FFI_THROW(ValueError) << "one batch row per walk matcher";
  bool record = forced_ok.size() > 0;
  if (record && static_cast<int64_t>(forced_ok.size()) != nw) {
    TVM_FFI_THROW(ValueError) << "one forced-draft flag per walk matcher";
  }
  std::vector<uint8_t> ask(static_cast<size_t>(nw), 0);
  for (int64_t w = 0; record && w < nw; ++w) ask[w] = forced_ok[w] != 0;
  std::vector<int64_t> keys(forced_keys.begin(), forced_keys.end());
  if (static_cast<int64_t>(source_lens.size()) != ns || static_cast<int64_t>(source_strides.size()) != ns) {
    TVM_FFI_THROW(ValueError) << "one lengths tensor and one stride per result";
  }
  // The results' tokens and accept lengths, as int64 values (a few hundred each).
  std::vector<std::vector<int64_t>> src_ids(static_cast<size_t>(ns)), src_lens(static_cast<size_t>(ns));
  for (int64_t s = 0; s < ns; ++s) {
    src_ids[s] = Int64s(source_ids[s], "next_token_ids", source_ids[s].numel());
    src_lens[s] = Int64s(source_lens[s], "accept_lens", source_lens[s].numel());
  }
  // Every run's tokens, resolved: (offset into ``tokens``, length).
  std::vector<int64_t> packed(feed_packed.begin(), feed_packed.end());
  std::vector<int64_t> tokens;
  std::vector<std::pair<size_t, int64_t>> run_at(static_cast<size_t>(nf));
  std::vector<uint8_t> live(static_cast<size_t>(nf), 0);
  size_t p = 0;
  for (int64_t f = 0; f < nf; ++f) {
    if (p + 3 > packed.size()) TVM_FFI_THROW(ValueError) << "packed runs end early at run " << f << " of " << nf;
    live[f] = packed[p] != 0;
    int64_t src = packed[p + 1];
    if (src < 0) {
      int64_t len = packed[p + 2];
      if (len < 0 || p + 3 + static_cast<size_t>(len) > packed.size()) {
        TVM_FFI_THROW(ValueError) << "packed runs end early at run " << f << " of " << nf;
      }
      run_at[f] = {tokens.size(), len};
      tokens.insert(tokens.end(), packed.begin() + p + 3, packed.begin() + p + 3 + len);
      p += 3 + static_cast<size_t>(len);
      continue;
    }
    if (src >= ns) TVM_FFI_THROW(IndexError) << "run " << f << " reads result " << src << " of " << ns;
    int64_t r = packed[p + 2];
    const std::vector<int64_t>& ids = src_ids[src];
    const std::vector<int64_t>& lens = src_lens[src];
    int64_t at = r, len = 1;
    if (!lens.empty()) {
      if (r < 0 || r >= static_cast<int64_t>(lens.size())) TVM_FFI_THROW(IndexError) << "run " << f << ": row " << r << " out of the result";
      at = r * source_strides[src];
      len = lens[r];
    }
    if (at < 0 || len < 0 || at + len > static_cast<int64_t>(ids.size())) {
      TVM_FFI_THROW(IndexError) << "run " << f << ": tokens [" << at << ", " << at + len << ") out of the result's "
                                << ids.size();
    }
    run_at[f] = {tokens.size(), len};
    tokens.insert(tokens.end(), ids.begin() + at, ids.begin() + at + len);
    p += 3;
  }
  if (p != packed.size()) TVM_FFI_THROW(ValueError) << "packed runs hold " << packed.size() - p << " values past the last run";
  int64_t bs = 0, n = 0, width = 0;
  int32_t* mask = nullptr;
  std::vector<int64_t> nxt, sib, tok;
  if (nw > 0) {
    if (nxt_t.ndim() != 2 || mask_t.ndim() != 2) TVM_FFI_THROW(ValueError) << "tree tensors must be [bs, n], mask 2-D";
    bs = nxt_t.shape()[0];
    n = nxt_t.shape()[1];
    width = mask_t.shape()[1];
    nxt = Int64s(nxt_t, "retrieve_next_token", bs * n);
    sib = Int64s(sib_t, "retrieve_next_sibling", bs * n);
    tok = Int64s(tok_t, "draft_tokens", bs * n);
    mask = Data<int32_t>(mask_t, "bitmask", bs * n * width);
  }
  // The rows to reset are rows of ``reset_t``, the whole reusable buffer, whose first rows ``mask_t`` views.
  std::vector<int64_t> reset(reset_rows.begin(), reset_rows.end());
  int32_t* buffer = nullptr;
  int64_t buffer_width = 0;
  if (!reset.empty()) {
    if (reset_t.ndim() != 2) TVM_FFI_THROW(ValueError) << "the buffer to reset must be 2-D";
    int64_t rows = reset_t.shape()[0];
    buffer_width = reset_t.shape()[1];
    buffer = Data<int32_t>(reset_t, "buffer", rows * buffer_width);
    if (nw > 0 && (buffer != mask || buffer_width != width)) {
      TVM_FFI_THROW(ValueError) << "the mask must be the first rows of the buffer to reset";
    }
    for (int64_t r : reset) {
      if (r < 0 || r >= rows) TVM_FFI_THROW(IndexError) << "reset row " << r << " out of [0, " << rows << ")";
    }
  }
  std::vector<int64_t> row(walk_rows.begin(), walk_rows.end());
  std::vector<uint8_t> seen(static_cast<size_t>(bs), 0);
  for (int64_t w = 0; w < nw; ++w) {
    if (row[w] < 0 || row[w] >= bs) TVM_FFI_THROW(IndexError) << "batch row " << row[w] << " out of [0, " << bs << ")";
    if (seen[row[w]]++) TVM_FFI_THROW(ValueError) << "batch row " << row[w] << " given twice";
  }
  // -- items: one per matcher, walk requests first in walk order, then matchers that are only fed --
  struct Item {
    ffi::ObjectRef matcher;
    int64_t walk = -1;
    std::vector<int64_t> feeds;
    bool failed = false;
  };
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(nw + nf));
  std::unordered_map<const void*, size_t> item_of;
  for (int64_t w = 0; w < nw; ++w) {
    ffi::ObjectRef mt = walk_matchers[w];
    if (!item_of.emplace(mt.get(), items.size()).second) {
      TVM_FFI_THROW(ValueError) << "matcher of batch row " << row[w] << " is walked twice (rows share a matcher)";
    }
    items.push_back({mt, w, {}, false});
  }
  for (int64_t f = 0; f < nf; ++f) {
    ffi::ObjectRef mt = feed_matchers[f];
    auto it = item_of.find(mt.get());
    if (it == item_of.end()) {
      it = item_of.emplace(mt.get(), items.size()).first;
      items.push_back({mt, -1, {}, false});
    }
    items[it->second].feeds.push_back(f);
  }
  // -- the work --
  std::vector<int64_t> fed(static_cast<size_t>(2 * nf), 0);
  std::vector<int64_t> status(static_cast<size_t>(nw), kWalkTerminated);
  std::vector<int64_t> valid(static_cast<size_t>(nw), 0);
  std::vector<uint8_t> written(static_cast<size_t>(bs * n), 0);
  std::vector<std::vector<Forced>> found(static_cast<size_t>(nw));  // per walk request: its thread's only
  std::vector<std::string> errors;
  std::mutex errors_lock;
  auto fail = [&](char kind, int64_t index, const std::exception_ptr& e) {
    std::lock_guard<std::mutex> guard(errors_lock);
    errors.push_back(std::string(1, kind) + std::to_string(index) + ": " + What(e));
  };
  // The budget counts from here, feeds and roots included (as the Python walk's deadline does), but only the walks
  // after the roots check it: a root row is always exact.
  bool has_deadline = budget_s >= 0;
  Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(budget_s));
  auto first_phase = [&](Item& item) {
    for (int64_t f : item.feeds) {
      if (item.failed) {
        fed[2 * f + 1] = kNotFed;
        continue;
      }
      try {
        FeedOne(m, item.matcher, live[f] != 0, tokens.data() + run_at[f].first, run_at[f].second, &fed[2 * f],
                &fed[2 * f + 1]);
      } catch (...) {
        fed[2 * f + 1] = kFeedError;  // fed[2 f] holds the tokens consumed before the exception
        item.failed = true;
        fail('f', f, std::current_exception());
      }
    }
    int64_t w = item.walk;
    if (w < 0) return;
    if (item.failed) {
      status[w] = kWalkFailed;
      return;
    }
    try {
      if (m.terminated(item.matcher).cast<bool>()) return;  // kWalkTerminated: rows untouched
      m.fill(item.matcher, mask_t, row[w] * n, false);
      written[row[w] * n] = 1;
      status[w] = kWalked;
      valid[w] = 1;
      if (ask[w]) RecordForced(m, item.matcher, row[w] * n, keys, &found[w]);
    } catch (...) {
      status[w] = kWalkFailed;
      fail('w', w, std::current_exception());
    }
  };
  auto second_phase = [&](int64_t w) {
    if (status[w] != kWalked) return;
    bool done = true;
    int64_t base = row[w] * n;
    try {
      valid[w] += WalkOne(m, walk_matchers[w], nxt.data() + base, sib.data() + base, tok.data() + base, n, base,
                          vocab, mask, width, mask_t, written.data(), has_deadline, deadline, &done, keys,
                          ask[w] ? &found[w] : nullptr);
      if (!done) status[w] = kWalkTimedOut;
    } catch (...) {
      status[w] = kWalkFailed;
      fail('w', w, std::current_exception());
    }
  };
  int64_t ni = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_first{0}, first_done{0}, next_second{0};
  std::function<void()> body = [&]() {
    for (int64_t j = next_first++; j < ni; j = next_first++) {
      first_phase(items[j]);
      ++first_done;
    }
    while (first_done.load() < ni) std::this_thread::yield();  // every root before any walk
    for (int64_t w = next_second++; w < nw; w = next_second++) second_phase(w);
  };
  Pool::Get().Run(std::min<int64_t>(threads, ni) - 1, body);
  // -- the sparse reset: stale rows of the previous build that this one did not fill --
  int64_t reset_count = 0;
  for (int64_t r : reset) {
    if (r < bs * n && written[r]) continue;
    std::fill(buffer + r * buffer_width, buffer + (r + 1) * buffer_width, -1);
    ++reset_count;
  }
  // -- the result --
  int64_t total = 0;
  for (int64_t w = 0; w < nw; ++w) {
    if (status[w] != kWalkFailed) total += valid[w];
  }
  std::vector<int64_t> out{total, reset_count, 0, static_cast<int64_t>(tokens.size()), 0};
  out.insert(out.end(), status.begin(), status.end());
  out.insert(out.end(), valid.begin(), valid.end());
  out.insert(out.end(), fed.begin(), fed.end());
  // every run's tokens as read (its length, then all runs' tokens in run order): the caller books the runs from
  // these instead of converting the results' tensors to lists itself
  for (int64_t f = 0; f < nf; ++f) out.push_back(run_at[f].second);
  out.insert(out.end(), tokens.begin(), tokens.end());
  // forced texts of requests whose walk did not fail (a failed walk's rows are the caller's to redo)
  std::vector<std::string> texts;
  for (int64_t w = 0; w < nw; ++w) {
    if (status[w] == kWalkFailed) continue;
    for (Forced& f : found[w]) {
      out.push_back(f.row);
      out.push_back(f.key);
      texts.push_back(std::move(f.text));
    }
  }
  out[4] = static_cast<int64_t>(texts.size());
  LastForced() = std::move(texts);
  for (int64_t r = 0; r < bs * n; ++r) {
    if (written[r]) out.push_back(r);
  }
  out[2] = static_cast<int64_t>(errors.size());
  LastErrors().messages = std::move(errors);
  return ffi::Shape(out);
}

ffi::Array<ffi::String> StepErrors() {
  ffi::Array<ffi::String> out;
  for (const std::string& e : LastErrors().messages) out.push_back(ffi::String(e));
  return out;
}

ffi::Array<ffi::String> StepForced() {
  ffi::Array<ffi::String> out;
  for (const std::string& t : LastForced()) out.push_back(ffi::String(t));
  return out;
}

// Looks the matcher methods up (raises if this xgrammar has no such type or methods) and returns the type key: the
// loader calls it once, so that a mismatch fails at load time, not in a step.
ffi::String Check() {
  M();
  return ffi::String(kMatcherType);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(check, Check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(step_batch, StepBatch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(step_errors, StepErrors);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(step_forced, StepForced);
