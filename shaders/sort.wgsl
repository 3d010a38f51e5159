// Sorting along the last dim of a contiguous [rows, len] tensor (from element `offset` of its
// buffer: a row of a larger tensor is a view), by rank: each invocation
// owns one element and counts the elements of its row that go before it (greater first when
// descending; ties by position, so the sort is stable). Its rank is where it lands: the
// sorted values and their source positions are written there, and the rank itself is kept,
// so that the backward gathers each element's grad from its rank (the inverse permutation;
// ranks past the k kept clamped to k, a zero grad).
// `topk` is the same pass writing only ranks below `keep`; a count stops once it reaches `keep`. NaN sorts as the largest value,
// as torch sorts it. Params: `SortParams` (src/ops/sort.rs). A row is walked in spans of
// `span` elements, one launch per span (`span_start`), each adding to the counts of the one
// before, so that no invocation loops more than llvmpipe allows.

@group(0) @binding(1) var<storage, read> src: array<f32>;
// Ranks so far, and the final ranks: [rows, len].
@group(0) @binding(2) var<storage, read_write> ranks: array<u32>;
// The sorted values and their positions: [rows, keep].
@group(0) @binding(3) var<storage, read_write> values: array<f32>;
@group(0) @binding(4) var<storage, read_write> indices: array<u32>;

// Whether a goes before b: greater first when descending, else smaller first; NaN is the
// largest value.
fn before(a: f32, b: f32) -> bool {
    let descending = pu(SORT_DESCENDING) == 1u;
    let a_nan = is_nan(a);
    let b_nan = is_nan(b);
    if (descending) {
        return (a_nan && !b_nan) || (!a_nan && !b_nan && a > b);
    }
    return (!a_nan && b_nan) || (!a_nan && !b_nan && a < b);
}

// Adds to element i's rank the elements of span [span_start, span_start + span) of its row
// that go before it.
@compute @workgroup_size(256)
fn count(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let len = pu(SORT_LEN);
    if (i >= pu(SORT_ROWS) * len) {
        return;
    }
    let row_at = i - i % len;
    let own = i % len;
    let base = pu(SORT_OFFSET);
    let x = src[base + i];
    let first = pu(SORT_SPAN_START);
    let last = min(first + pu(SORT_SPAN), len);
    var rank = select(0u, ranks[i], first > 0u);
    // An element whose rank reaches `keep` is not kept, whatever comes after: `topk` of a few
    // of a vocabulary's logits stops most counts early (for sort, keep is len: never).
    let keep = pu(SORT_KEEP);
    for (var j = first; j < last && rank < keep; j = j + 1u) {
        let y = src[base + row_at + j];
        // Ties (NaN with NaN too) go in position order.
        let tie = !before(x, y) && !before(y, x);
        rank = rank + select(0u, 1u, before(y, x) || (tie && j < own));
    }
    ranks[i] = rank;
}

// Writes each element whose rank is below `keep` to its place, and leaves its rank clamped to
// `keep` (where the backward finds a zero grad for the elements not kept).
@compute @workgroup_size(256)
fn place(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let len = pu(SORT_LEN);
    if (i >= pu(SORT_ROWS) * len) {
        return;
    }
    let rank = ranks[i];
    let keep = pu(SORT_KEEP);
    if (rank < keep) {
        let at = (i / len) * keep + rank;
        values[at] = src[pu(SORT_OFFSET) + i];
        indices[at] = i % len;
    }
    ranks[i] = min(rank, keep);
}
