// The Hopper backward's work assignment (flash_bwd_sm90.cu): which key block, head-dim chunk,
// KV head and batch entry a CTA takes (CtaWork, cta_work: the dispatch order), and the steps of
// that key block, (query head, query block) pairs walked in the same order by the producer, the
// dQ thread and the consumers (QueryBlockWalk).
#pragma once
#include "hopper_primitives.cuh"

// The steps of a key block, one per (query head of its KV head's group, query block whose rows
// see its keys) pair, taken in the same order by the producer, the dQ thread and the consumers.
// By default head by head, each head's query blocks from the first up (the CTAs of one head then
// walk the same Q / dO blocks together and share them in L2). BLOCK_MAJOR (deterministic mode):
// query block by query block from the first up, every head of the group inside a block, so a
// key block takes the pair (head, m) at step (m - m_first) * heads + head. The ordered additions
// go from the highest key block down; a higher key block's m_first is no smaller, so it takes
// every pair at the same step or earlier and the next adder finds it done. (From the last query
// block down, where every range ends, all key blocks meet a pair at the same step, but causal key
// block n's rows start at block 2n (BLOCK_N = 2 BLOCK_M): the adders in ascending order then
// stand in a chain, key block n waiting about n reductions' latencies, a causal mask's
// short high key blocks idling on their SMs.)
template <bool BLOCK_MAJOR>
struct QueryBlockWalk {
    int head, m_block;  // the step's query head and query block
    int head_first, head_end, m_first, m_end;

    CF2_DEVICE QueryBlockWalk(int head0, int heads, int m_first_, int m_count)
        : head(head0), m_block(m_first_), head_first(head0), head_end(head0 + heads),
          m_first(m_first_), m_end(m_first_ + m_count) {}

    CF2_DEVICE void advance() {
        if constexpr (BLOCK_MAJOR) {
            if (++head == head_end) {
                head = head_first;
                ++m_block;
            }
        } else if (++m_block == m_end) {
            m_block = m_first;
            ++head;
        }
    }
};

// Which (key block x head-dim chunk, KV head, batch entry) a CTA of the grid (key blocks x
// chunks, KV heads, batch) takes, in the order the GPU dispatches the CTAs (x fastest).
// DETERMINISTIC: x reversed, each (KV head, batch) pair's last key block first, so that the ones
// a key block waits for (above) were dispatched before it. Otherwise key-block-major inside
// groups of `group_pairs` (KV head, batch) pairs: key block 0 of every pair of the group, then
// key block 1, and so on (group_pairs 1: pair by pair, the grid's own order). Under a causal
// mask the low key blocks are the long ones (they see the most query rows): grouped, each
// group's long CTAs start first and its short ones fill the tail, where pair by pair the last
// pair's key block 0 starts last and runs alone. The host chooses the groups
// (_dispatch.dispatch_group_pairs).
// `batch_inner` (not DETERMINISTIC): the pairs in the order (batch entry fastest, KV head), for
// a bias broadcast over the batch (BiasTile::batch_inner): the CTAs of one (key block, head) for
// every batch entry close together, reading the bias's column of tiles at about the same time.
struct CtaWork {
    int x, kv_head, batch;
};

template <bool DETERMINISTIC>
CF2_DEVICE CtaWork cta_work(int group_pairs, bool batch_inner = false) {
    if constexpr (DETERMINISTIC)
        return {static_cast<int>(gridDim.x - 1 - blockIdx.x), static_cast<int>(blockIdx.y),
                static_cast<int>(blockIdx.z)};
    group_pairs = max(group_pairs, 1);  // a struct filled without it (0): pair by pair
    const int xs = gridDim.x, pairs = gridDim.y * gridDim.z;
    const int cta = blockIdx.x + xs * (blockIdx.y + gridDim.y * blockIdx.z);
    const int first_pair = cta / (group_pairs * xs) * group_pairs;
    const int group_size = min(group_pairs, pairs - first_pair);  // the last group: the rest
    const int in_group = cta - first_pair * xs;
    const int pair = first_pair + in_group % group_size;
    if (batch_inner)
        return {in_group / group_size, pair / static_cast<int>(gridDim.z),
                pair % static_cast<int>(gridDim.z)};
    return {in_group / group_size, pair % static_cast<int>(gridDim.y),
            pair / static_cast<int>(gridDim.y)};
}
