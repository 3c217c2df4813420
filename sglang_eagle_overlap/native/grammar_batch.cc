// sglang-eagle-overlap: one native call per verify step for the batch's xgrammar work (issue 17).
//
// Why: the grammar work of a constrained EAGLE step is a few native calls per request and per tree node (accept,
// rollback, is_terminated, fill). Made from Python, each one is a Python frame, an argument conversion and a GIL
// release and re-acquire inside tvm-ffi's call; at bs 64 that per-call overhead is most of the step's grammar time.
// Here the same calls are made from C++, for the whole batch, behind one Python call.
//
// How: xgrammar 0.2.x binds its GrammarMatcher as a tvm-ffi object type whose methods are registered by reflection
// ("xgrammar.tvm_ffi_binding.GrammarMatcher": accept_token, rollback, is_terminated, fill_next_token_bitmask). This
// file finds those methods through tvm-ffi's stable C ABI (reflection::GetMethod) and calls them as ffi::Function:
// it uses no xgrammar header and depends on no xgrammar ABI beyond the registered method signatures, which are
// checked when the methods are looked up. Built per environment against that environment's tvm-ffi headers
// (sglang_eagle_overlap/core/native.py), loaded with tvm_ffi.load_module; tvm-ffi releases the GIL for the call.
//
// The semantics are those of sglang_eagle_overlap/core/mask.py (the lockstep walk: _Walker) and core/ledger.py
// (_feed_matcher), which stay the reference implementation and the fallback; tests compare the two bit for bit.

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/accessor.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

constexpr const char* kMatcherType = "xgrammar.tvm_ffi_binding.GrammarMatcher";

struct Methods {
  ffi::Function accept;      // (matcher, int token, bool debug) -> bool
  ffi::Function rollback;    // (matcher, int k) -> None
  ffi::Function terminated;  // (matcher) -> bool
  ffi::Function fill;        // (matcher, tensor bitmask, int row, bool debug) -> bool
};

const Methods& M() {
  static const Methods m{
      ffi::reflection::GetMethod(kMatcherType, "accept_token"),
      ffi::reflection::GetMethod(kMatcherType, "rollback"),
      ffi::reflection::GetMethod(kMatcherType, "is_terminated"),
      ffi::reflection::GetMethod(kMatcherType, "fill_next_token_bitmask"),
  };
  return m;
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

// fn(j) for j in [0, k) on up to ``threads`` threads (the caller's included), items handed out one at a time. Items
// must be independent (distinct matchers, distinct mask rows). The first exception stops the hand-out; it is
// rethrown once every thread has finished the item it was on.
template <typename Fn>
void ParallelFor(int64_t k, int64_t threads, Fn fn) {
  if (threads <= 1 || k <= 1) {
    for (int64_t j = 0; j < k; ++j) fn(j);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr error;
  std::mutex error_lock;
  auto work = [&]() {
    for (int64_t j = next++; j < k && !stop; j = next++) {
      try {
        fn(j);
      } catch (...) {
        std::lock_guard<std::mutex> guard(error_lock);
        if (!error) error = std::current_exception();
        stop = true;
      }
    }
  };
  int64_t extra = std::min<int64_t>(threads, k) - 1;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(extra));
  for (int64_t t = 0; t < extra; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// One request's tree walk (mask.py's _Walker, without its pauses): DFS in the order of the Python walk, filling the
// row of every valid, non-terminating node after the root (whose row the caller filled). Returns the valid nodes
// walked; sets *done to false if the deadline passed first (then the request's non-root rows are all-allowed again).
// The matcher is always left in its entry state, also when a method throws (the exception then propagates).
int64_t WalkOne(const Methods& m, const ffi::ObjectRef& matcher, const int64_t* nxt, const int64_t* sib,
                const int64_t* tok, int64_t n, int64_t base, int64_t vocab, int32_t* mask, int64_t width,
                const ffi::TensorView& mask_view, uint8_t* written, bool has_deadline, Clock::time_point deadline,
                bool* done) {
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

// The batch's tree mask (mask.py: TreeMaskBuilder._lockstep): for every request k (batch row rows[k], its matcher
// matchers[k]) that is not terminated, its root row is filled (all roots first, before any deadline check), then its
// tree is walked. Returns the batch's valid nodes, k status values, then the rows filled (any order): status -1
// (terminated: rows untouched), or the number of valid nodes (root included), or -(2 + valid nodes) if the time limit
// cut its walk. ``budget_s`` < 0: no time limit. ``threads`` > 1 spreads the requests over that many threads (xgrammar's own batched fill does
// the same with its pool: matchers of different requests are independent).
ffi::Shape WalkTrees(ffi::Array<ffi::ObjectRef> matchers, ffi::Array<int64_t> rows, ffi::TensorView nxt_t,
                     ffi::TensorView sib_t, ffi::TensorView tok_t, ffi::TensorView mask_t, int64_t vocab,
                     double budget_s, int64_t threads) {
  const Methods& m = M();
  int64_t k = static_cast<int64_t>(matchers.size());
  if (static_cast<int64_t>(rows.size()) != k) TVM_FFI_THROW(ValueError) << "one batch row per matcher";
  if (nxt_t.ndim() != 2 || mask_t.ndim() != 2) TVM_FFI_THROW(ValueError) << "tree tensors must be [bs, n], mask 2-D";
  int64_t bs = nxt_t.shape()[0];
  int64_t n = nxt_t.shape()[1];
  int64_t width = mask_t.shape()[1];
  std::vector<int64_t> nxt = Int64s(nxt_t, "retrieve_next_token", bs * n);
  std::vector<int64_t> sib = Int64s(sib_t, "retrieve_next_sibling", bs * n);
  std::vector<int64_t> tok = Int64s(tok_t, "draft_tokens", bs * n);
  int32_t* mask = Data<int32_t>(mask_t, "bitmask", bs * n * width);
  std::vector<int64_t> row(rows.begin(), rows.end());
  std::vector<ffi::ObjectRef> ms(matchers.begin(), matchers.end());
  std::vector<uint8_t> seen(static_cast<size_t>(bs), 0);
  for (int64_t j = 0; j < k; ++j) {
    if (row[j] < 0 || row[j] >= bs) TVM_FFI_THROW(IndexError) << "batch row " << row[j] << " out of [0, " << bs << ")";
    if (seen[row[j]]++) TVM_FFI_THROW(ValueError) << "batch row " << row[j] << " given twice";
  }
  std::vector<int64_t> status(static_cast<size_t>(k), 0);
  std::vector<uint8_t> written(static_cast<size_t>(bs * n), 0);
  // The budget counts from here, roots included (as the Python walk's deadline does), but only the walks after the
  // roots check it: a root row is always exact.
  bool has_deadline = budget_s >= 0;
  Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(budget_s));
  // Round 0: every root.
  ParallelFor(k, threads, [&](int64_t j) {
    if (m.terminated(ms[j]).cast<bool>()) {
      status[j] = -1;
      return;
    }
    m.fill(ms[j], mask_t, row[j] * n, false);
    written[row[j] * n] = 1;
    status[j] = 1;
  });
  ParallelFor(k, threads, [&](int64_t j) {
    if (status[j] < 0) return;
    bool done = true;
    int64_t base = row[j] * n;
    int64_t v = 1 + WalkOne(m, ms[j], nxt.data() + base, sib.data() + base, tok.data() + base, n, base, vocab, mask,
                            width, mask_t, written.data(), has_deadline, deadline, &done);
    status[j] = done ? v : -(2 + v);
  });
  int64_t total = 0;  // valid nodes of the batch: terminated requests count none, cut ones what they walked
  for (int64_t st : status) total += st >= 0 ? st : (st <= -2 ? -st - 2 : 0);
  std::vector<int64_t> out{total};
  out.insert(out.end(), status.begin(), status.end());
  for (int64_t r = 0; r < bs * n; ++r) {
    if (written[r]) out.push_back(r);
  }
  return ffi::Shape(out);
}

// The ledger's fresh runs (ledger.py: _feed_matcher) in one call. ``packed`` holds, per matcher in order, its
// ``live`` flag (1: the ledger's own last run left that matcher not terminated, so no check before the run), the
// run's length and its tokens. Returns two values per run: tokens retained, then 0 (run fed whole, not terminated),
// 1 (terminated after the last retained token), 2 (rejected the token after the retained ones) or 3 (terminated
// before the run: nothing fed).
ffi::Shape FeedRuns(ffi::Array<ffi::ObjectRef> matchers, ffi::Array<int64_t> packed) {
  const Methods& m = M();
  int64_t k = static_cast<int64_t>(matchers.size());
  std::vector<int64_t> in(packed.begin(), packed.end());
  std::vector<int64_t> out(static_cast<size_t>(2 * k), 0);
  size_t p = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (p + 2 > in.size() || in[p + 1] < 0 || p + 2 + static_cast<size_t>(in[p + 1]) > in.size()) {
      TVM_FFI_THROW(ValueError) << "packed runs end early at run " << j << " of " << k;
    }
    bool live = in[p] != 0;
    size_t len = static_cast<size_t>(in[p + 1]);
    const int64_t* tok = in.data() + p + 2;
    p += 2 + len;
    ffi::ObjectRef mt = matchers[j];
    int64_t kept = 0;
    int64_t state = 0;
    if (!live && m.terminated(mt).cast<bool>()) {
      state = 3;
    } else {
      for (size_t i = 0; i < len; ++i) {
        if (!m.accept(mt, tok[i], false).cast<bool>()) {
          state = (kept == 0 && m.terminated(mt).cast<bool>()) ? 3 : 2;
          break;
        }
        ++kept;
        if (m.terminated(mt).cast<bool>()) {
          state = 1;
          break;
        }
      }
    }
    out[2 * j] = kept;
    out[2 * j + 1] = state;
  }
  if (p != in.size()) TVM_FFI_THROW(ValueError) << "packed runs hold " << in.size() - p << " values past the last run";
  return ffi::Shape(out);
}

// Looks the matcher methods up (raises if this xgrammar has no such type or methods) and returns the type key: the
// loader calls it once, so that a mismatch fails at load time, not in a step.
ffi::String Check() {
  M();
  return ffi::String(kMatcherType);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(check, Check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(walk_trees, WalkTrees);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(feed_runs, FeedRuns);
