// Sorting along the last dim of a contiguous [rows, len] tensor read from element `offset` of
// its buffer (a row of a larger tensor is a view), stable (equal elements keep their order)
// with NaN the largest value, as torch sorts. A merge sort, one invocation per element in
// every pass: `sort_runs` sorts each run of 64 elements of a row (RUN in src/ops/sort.rs) by
// counting, for each element, the elements of its run that go before it; each `merge_runs`
// pass merges neighbouring runs of `width` into runs of twice that, each element finding its
// place in the other run by binary search; `finish` writes the first `keep` of each row
// (`topk`'s k, or the whole row) and each element's rank, where the backward gathers its
// grad from (ranks past the k kept are clamped to k: a zero grad). No invocation loops more
// than 64 times, whatever the row's length. Params: `SortParams` (src/ops/sort.rs).

@group(0) @binding(1) var<storage, read> src: array<f32>;
// Each element's rank in its row: [rows, len].
@group(0) @binding(2) var<storage, read_write> ranks: array<u32>;
// The first `keep` sorted values of each row and their positions: [rows, keep].
@group(0) @binding(3) var<storage, read_write> values: array<f32>;
@group(0) @binding(4) var<storage, read_write> indices: array<u32>;
// A pass's sorted runs, in and out: values and their positions in the row, [rows, len].
@group(0) @binding(5) var<storage, read> keys_in: array<f32>;
@group(0) @binding(6) var<storage, read> positions_in: array<u32>;
@group(0) @binding(7) var<storage, read_write> keys_out: array<f32>;
@group(0) @binding(8) var<storage, read_write> positions_out: array<u32>;

// Whether a goes before b: greater first when descending, else smaller first; NaN is the
// largest value. Neither goes before the other when they tie (NaN with NaN too).
fn before(a: f32, b: f32) -> bool {
    let descending = pu(SORT_DESCENDING) == 1u;
    let a_nan = is_nan(a);
    let b_nan = is_nan(b);
    if (descending) {
        return (a_nan && !b_nan) || (!a_nan && !b_nan && a > b);
    }
    return (!a_nan && b_nan) || (!a_nan && !b_nan && a < b);
}

// Each element's place in its run of 64: the run's elements that go before it, ties in
// position order.
@compute @workgroup_size(256)
fn sort_runs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let len = pu(SORT_LEN);
    if (i >= pu(SORT_ROWS) * len) {
        return;
    }
    let row_at = i - i % len;
    let own = i - row_at;
    let run = own - own % 64u;
    let run_end = min(run + 64u, len);
    let base = pu(SORT_OFFSET) + row_at;
    let x = src[base + own];
    var rank = 0u;
    for (var j = run; j < run_end; j = j + 1u) {
        let y = src[base + j];
        let tie = !before(x, y) && !before(y, x);
        rank = rank + select(0u, 1u, before(y, x) || (tie && j < own));
    }
    keys_out[row_at + run + rank] = x;
    positions_out[row_at + run + rank] = own;
}

// Merges runs of `width` pairwise. An element of the first run of a pair goes after the
// second run's elements that go strictly before it; one of the second run after the first
// run's elements that go before it or tie with it (earlier positions first: stable).
@compute @workgroup_size(256)
fn merge_runs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let len = pu(SORT_LEN);
    if (i >= pu(SORT_ROWS) * len) {
        return;
    }
    let row_at = i - i % len;
    let own = i - row_at;
    let width = pu(SORT_WIDTH);
    let pair = own - own % (2u * width);
    let mid = min(pair + width, len);
    let pair_end = min(pair + 2u * width, len);
    let x = keys_in[i];
    var place = 0u;
    if (own < mid) {
        var lo = mid;
        var hi = pair_end;
        while (lo < hi) {
            let m = (lo + hi) / 2u;
            if (before(keys_in[row_at + m], x)) {
                lo = m + 1u;
            } else {
                hi = m;
            }
        }
        place = own + (lo - mid);
    } else {
        var lo = pair;
        var hi = mid;
        while (lo < hi) {
            let m = (lo + hi) / 2u;
            if (!before(x, keys_in[row_at + m])) {
                lo = m + 1u;
            } else {
                hi = m;
            }
        }
        place = (own - mid) + lo;
    }
    keys_out[row_at + place] = x;
    positions_out[row_at + place] = positions_in[i];
}

// The first `keep` of each sorted row, and every element's rank (clamped to `keep`).
@compute @workgroup_size(256)
fn finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let len = pu(SORT_LEN);
    if (i >= pu(SORT_ROWS) * len) {
        return;
    }
    let row = i / len;
    let rank = i - row * len;
    let position = positions_in[i];
    let keep = pu(SORT_KEEP);
    ranks[row * len + position] = min(rank, keep);
    if (rank < keep) {
        values[row * keep + rank] = keys_in[i];
        indices[row * keep + rank] = position;
    }
}
