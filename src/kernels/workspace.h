// Per-thread scratch memory for the kernels: grows to the largest request and is reused across
// calls, so a kernel touches no fresh pages after warm-up (a page fault costs ~1.6 µs here).
// Memory per thread is what one task needs: O((D + Dv + key block) × rows), and what a kernel
// keeps across its tasks within a stated limit (the backward's packed query blocks, the bfloat16
// forward's packed values).
#ifndef MHA_KERNELS_WORKSPACE_H_
#define MHA_KERNELS_WORKSPACE_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace mha::kernels {

class Workspace {
 public:
  // One buffer per slot. A slot holds one array of one kernel while that kernel runs on this
  // thread; kernels do not nest, so the forward, weights and backward passes share the tile's
  // slots and the query/score blocks.
  enum Slot : int {
    // The tile of query rows (flash_blocks-inl.h): visible key range, head and query of each row.
    kTileLo, kTileHi, kTileLoRel, kTileHiRel, kTileHead, kTileQuery, kTileValid,
    // ALiBi per row of the tile: slope, query position, position relative to the block.
    kTileSlope, kTilePos, kTilePosRel,
    // Sink tokens past a gap per row (KeyRange::sink_hi), absolute and relative to the block.
    kTileSinkHi, kTileSinkRel,
    // Forward and weights passes (flash_fwd.cc, flash_weights.cc); the backward reuses kScores.
    kQueryT, kScores, kOutT, kRowMax, kRowSum, kRescale, kNonfinite, kOutSpill, kRowSumSpill,
    kRowMaxSpill,
    // 16-bit inputs widened to float32 (flash_blocks-inl.h StageRows / PackQueries): the task's
    // query rows, and the key and value rows of one block.
    kQueryStage, kKeyStage, kValueStage,
    // The bfloat16 forward with AMX tiles (flash_amx-inl.h): the task's query words, a block's
    // probabilities in key pairs, its values transposed, and its key rows where a tile would read
    // past the last.
    kAmxQueryPairs, kAmxProbPairs, kAmxValueT, kAmxKeyStage,
    // ... and a kv head's value blocks in tile layout, kept across the thread's tasks of the head
    // (ThreadValues), and which are packed.
    kAmxThreadValues, kAmxThreadReady,
    // Backward (flash_bwd.cc).
    kBwdDq, kBwdGradP, kBwdDroppedP, kBwdKeyBlock,
    kBwdDkBlock, kBwdDvBlock, kBwdDqGroup, kBwdLse, kBwdRowDot, kBwdRowStats, kBwdGradOutStage,
    kBwdSoftcapGrad, kBwdScoreGrad, kBwdRowScratch,
    // The backward's query blocks, Q and dO in both layouts (all of a task's, or one at a time),
    // and which of them are packed.
    kBwdPacked, kBwdPackedBlocks,
    // The bfloat16 backward with AMX tiles (flash_bwd_amx-inl.h): the key block transposed, a
    // block pair's P_d and dS rounded (and dS in key pairs), and the task's dQ transposed per
    // query block.
    kAmxBwdKeysT, kAmxBwdProbs, kAmxBwdGrads, kAmxBwdGradPairs, kAmxBwdDqT,
    // attention_backward (src/ops/attention_backward.cc): a broadcast bias's full gradient.
    kBwdBiasGradFull,
    // Decoding (flash_decode.cc).
    kDecodeQuery, kDecodeKeyStage, kDecodeScores, kDecodeRescale, kDecodeSeen, kDecodeMerge,
    kDecodeOut, kDecodeMax, kDecodeSum, kDecodeQuerySums, kDecodeQueryWords, kDecodeQueryVectors, kDecodeWeightPairs,
    kDecodeSavedOut,
    kDecodeValueScales, kDecodeValueWeights, kDecodeValueMins, kDecodeValueBytes, kDecodeValueWords, kDecodeValueSteps,
    // bfloat16 values with AMX tiles (decode_amx-inl.h): a block's weights tiles, its staged rows, the sums.
    kDecodeValueTiles, kDecodeValueStage, kDecodeValueSums,
    // varlen_attention (src/ops/varlen.cc): one sequence's rows, head-major, around the kernel calls.
    kVarlenQuery, kVarlenKey, kVarlenValue, kVarlenOut, kVarlenGradOut, kVarlenGradQuery, kVarlenGradKey,
    kVarlenGradValue,
    // MultiHeadAttention training with QK-norm (src/modules/multi_head_attention_internal.h): q and
    // k after QK-norm and rotary, token-major, around the attention calls of a forward or backward.
    kModuleNormedQuery, kModuleNormedKey,
    // attention() (src/ops/attention.cc): keys and values gathered head-major for the forward.
    kGatherKey, kGatherValue,
    kSlots
  };

  // This thread's workspace.
  static Workspace& local() {
    thread_local Workspace ws;
    return ws;
  }

  // `count` elements of T, 64-byte aligned, contents undefined. Slots are independent buffers.
  // Throws std::bad_alloc when memory runs out.
  template <typename T>
  T* get(Slot slot, size_t count) {
    const size_t bytes = (count * sizeof(T) + 63) / 64 * 64 + 64;
    if (bytes > size_[slot]) {
      std::free(data_[slot]);
      data_[slot] = std::aligned_alloc(64, bytes);
      size_[slot] = data_[slot] ? bytes : 0;
      if (!data_[slot]) throw std::bad_alloc();
    }
    return static_cast<T*>(data_[slot]);
  }

  // Frees a slot's buffer (for slots that may hold O(sequence) data).
  void release(Slot slot) {
    std::free(data_[slot]);
    data_[slot] = nullptr;
    size_[slot] = 0;
  }

  // The most bytes a thread keeps across calls in slots that may hold O(sequence) data (the
  // varlen and QK-norm slots): fresh pages cost ~1.6 µs each, so a call's scratch is reused, but
  // one long call should not pin its memory for the thread's life.
  static constexpr size_t kKeepBytes = size_t{256} << 20;

  // Frees slots first .. last (inclusive) if together they hold more than kKeepBytes.
  void trim(Slot first, Slot last) {
    size_t total = 0;
    for (int s = first; s <= last; ++s) total += size_[s];
    if (total <= kKeepBytes) return;
    for (int s = first; s <= last; ++s) release(static_cast<Slot>(s));
  }

  size_t size(Slot slot) const { return size_[slot]; }

  // Bytes this thread's workspace holds now.
  size_t bytes() const {
    size_t total = 0;
    for (size_t s : size_) total += s;
    return total;
  }

  ~Workspace() {
    for (void* p : data_) std::free(p);
  }

 private:
  Workspace() = default;
  void* data_[kSlots] = {};
  size_t size_[kSlots] = {};
};

}  // namespace mha::kernels

#endif  // MHA_KERNELS_WORKSPACE_H_
