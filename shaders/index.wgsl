// Ops that produce or consume u32 indices: argmax, index_select, gather. Elements move as raw
// 32-bit words (argmax reads them as f32), so the selecting kernels serve f32 and u32 alike.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
@group(0) @binding(3) var<storage, read> indices: array<u32>;
// index_select_scatter: the input grad as f32 bits, zeroed first, summed into atomically.
@group(0) @binding(4) var<storage, read_write> sums: array<atomic<u32>>;

// The index of the first maximum of each row of an [M, K] strided view (the first NaN, if
// any: NaN counts as the maximum, as in PyTorch), over chunks of at most `chunk_len` elements
// (llvmpipe ends an invocation's loops after 65,535 iterations). One invocation per (row,
// chunk); with one chunk it writes the index, else (value bits, index) pairs for
// `argmax_join`.
@compute @workgroup_size(256)
fn argmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let t = workgroup_index(wid, nwg) * 256u + lid;
    let chunks = pu(REDUCE_CHUNKS);
    if (t >= pu(REDUCE_ROWS) * chunks) {
        return;
    }
    let row = t / chunks;
    let chunk = t % chunks;
    let base = pu(REDUCE_OFFSET) + row * pu(REDUCE_ROW_STRIDE);
    let ks = pu(REDUCE_K_STRIDE);
    let start = chunk * pu(REDUCE_CHUNK_LEN);
    let end = min(start + pu(REDUCE_CHUNK_LEN), pu(REDUCE_LEN));
    var best = bitcast<f32>(src[base + start * ks]);
    var best_k = start;
    for (var k = start + 1u; k < end; k = k + 1u) {
        let v = bitcast<f32>(src[base + k * ks]);
        if (v > best || (is_nan(v) && !is_nan(best))) {
            best = v;
            best_k = k;
        }
    }
    if (chunks == 1u) {
        dst[row] = best_k;
    } else {
        dst[2u * t] = bitcast<u32>(best);
        dst[2u * t + 1u] = best_k;
    }
}

// Joins `argmax`'s chunks: `src` holds (value bits, index) per (row, chunk); the first chunk
// with the largest value (or the first NaN) wins.
@compute @workgroup_size(256)
fn argmax_join(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 256u + lid;
    if (row >= pu(REDUCE_ROWS)) {
        return;
    }
    let chunks = pu(REDUCE_CHUNKS);
    let first = 2u * row * chunks;
    var best = bitcast<f32>(src[first]);
    var best_k = src[first + 1u];
    for (var c = 1u; c < chunks; c = c + 1u) {
        let v = bitcast<f32>(src[first + 2u * c]);
        if (v > best || (is_nan(v) && !is_nan(best))) {
            best = v;
            best_k = src[first + 2u * c + 1u];
        }
    }
    dst[row] = best_k;
}

// The row of the table that element `i` of an index_select's result picks.
fn picked_row(i: u32) -> u32 {
    let j = (i / pu(INDEX_SELECT_INNER)) % pu(INDEX_SELECT_SELECTED);
    return indices[pu(INDEX_SELECT_INDICES_OFFSET) + j];
}

const OUTSIDE_WINDOW: u32 = 0xffffffffu;

// Where element `i` of an index_select's result, picking table row `row`, lies in the bound
// window of the table (rows ROW_START .. ROW_START + ROW_COUNT: all of them unless the table
// is bound a window at a time), or OUTSIDE_WINDOW.
fn table_element(i: u32, row: u32) -> u32 {
    let inner = pu(INDEX_SELECT_INNER);
    let o = i / (pu(INDEX_SELECT_SELECTED) * inner);
    let row_start = pu(INDEX_SELECT_ROW_START);
    let row_count = pu(INDEX_SELECT_ROW_COUNT);
    if (row < row_start || row - row_start >= row_count) {
        return OUTSIDE_WINDOW;
    }
    return pu(INDEX_SELECT_TABLE_OFFSET) + (o * row_count + row - row_start) * inner + i % inner;
}

// index_select of a contiguous tensor seen as [outer, dim, inner]:
// dst[o, j, i] = src[o, indices[j], i].
@compute @workgroup_size(256)
fn index_select(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(INDEX_SELECT_N)) {
        return;
    }
    let at = table_element(i, min(picked_row(i), pu(INDEX_SELECT_DIM_SIZE) - 1u));
    if (at != OUTSIDE_WINDOW) {
        dst[i] = src[at];
    }
}

// gather along `dim`: dst[..., j, ...] = src[..., indices[..., j, ...], ...], with dst shaped
// like the (contiguous) indices and src read through its strides.
@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(GATHER_N)) {
        return;
    }
    let idx = min(indices[pu(GATHER_INDICES_OFFSET) + i], pu(GATHER_SRC_DIM_SIZE) - 1u);
    var rem = i;
    var off = pu(GATHER_SRC_OFFSET);
    let rank = pu(GATHER_RANK);
    let dim = pu(GATHER_DIM);
    for (var k = 0u; k < rank; k = k + 1u) {
        let d = 5u - k;
        let n = pu(GATHER_SHAPE + d);
        var coord = rem % n;
        if (d == dim) {
            coord = idx;
        }
        off = off + coord * pu(GATHER_SRC_STRIDES + d);
        rem = rem / n;
    }
    dst[i] = src[off];
}

// The grad of index_select: dst[o, p, i] = sum of src[o, j, i] over the j with indices[j] == p,
// for src (the incoming grad, contiguous [outer, selected, inner]) and dst contiguous
// [outer, dim size, inner]. One invocation per run of 16 elements of a dst row (`n` counts the
// runs), so repeated indices need no atomics and each index is read once per 16 sums (read
// once per element, the token embedding's grad of a small GPT took 28 ms on lavapipe).
// A matching lookup adds its run 4 elements at a time in a rolled loop: one group's 4 load
// sites instead of the run's 16, which a software adapter compiles into a loop over lanes each
// (0.46 s of a GPT's first step on lavapipe 25 with all 16). The loop costs up to 4 iterations
// per lookup against llvmpipe's limit, so the host passes at most `INDEX_SELECT_GRAD_CHUNK`
// lookups per launch (src/ops/index.rs).
@compute @workgroup_size(256)
fn index_select_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let t = workgroup_index(wid, nwg) * 256u + lid;
    if (t >= pu(INDEX_SELECT_N)) {
        return;
    }
    let inner = pu(INDEX_SELECT_INNER);
    let dim_size = pu(INDEX_SELECT_DIM_SIZE);
    let runs = (inner + 15u) / 16u;
    let first = (t % runs) * 16u;
    let p = (t / runs) % dim_size;
    let o = t / (runs * dim_size);
    let count = min(16u, inner - first);
    let selected = pu(INDEX_SELECT_SELECTED);
    let src_offset = pu(INDEX_SELECT_SRC_OFFSET);
    let indices_offset = pu(INDEX_SELECT_INDICES_OFFSET);
    // Each a group of 4 of the run: acc[q] holds elements 4q .. 4q + 4.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let groups = rolled((count + 3u) / 4u);
    for (var j = 0u; j < selected; j = j + 1u) {
        if (indices[indices_offset + j] == p) {
            let at = src_offset + (o * selected + j) * inner + first;
            for (var q = 0u; q < groups; q = q + 1u) {
                let v = grad_run4(at, 4u * q, count);
                acc0 = acc0 + select(vec4<f32>(0.0), v, q == 0u);
                acc1 = acc1 + select(vec4<f32>(0.0), v, q == 1u);
                acc2 = acc2 + select(vec4<f32>(0.0), v, q == 2u);
                acc3 = acc3 + select(vec4<f32>(0.0), v, q == 3u);
            }
        }
    }
    let out = (o * dim_size + p) * inner + first;
    // Stored a group of 4 per iteration, as summed: a loop of 16 single stores picking each
    // element out of its group compiled 50 ms slower on lavapipe 25.
    for (var q = 0u; q < groups; q = q + 1u) {
        let v = select(select(acc0, acc1, q == 1u), select(acc2, acc3, q == 3u), q >= 2u);
        let at = out + 4u * q;
        dst[at] = bitcast<u32>(v.x);
        if (4u * q + 1u < count) {
            dst[at + 1u] = bitcast<u32>(v.y);
        }
        if (4u * q + 2u < count) {
            dst[at + 2u] = bitcast<u32>(v.z);
        }
        if (4u * q + 3u < count) {
            dst[at + 3u] = bitcast<u32>(v.w);
        }
    }
}

// Element `e` of the run of `count` incoming grad elements from `at`, 0 past its end.
fn grad_at(at: u32, e: u32, count: u32) -> f32 {
    if (e < count) {
        return bitcast<f32>(src[at + e]);
    }
    return 0.0;
}

// Elements k..k+4 of the run.
fn grad_run4(at: u32, k: u32, count: u32) -> vec4<f32> {
    return vec4<f32>(grad_at(at, k, count), grad_at(at, k + 1u, count),
                     grad_at(at, k + 2u, count), grad_at(at, k + 3u, count));
}

// The grad of gather along `dim`: dst[c] = sum of src[c with dim -> j] over the j with
// indices[c with dim -> j] == c[dim], where src (the incoming grad) and indices are contiguous
// with the indices' shape, and dst is contiguous with the input's shape. Positions outside the
// indices' extent get 0.
@compute @workgroup_size(256)
fn gather_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(GATHER_BACKWARD_N)) {
        return;
    }
    let dim = pu(GATHER_BACKWARD_DIM);
    var coord: array<u32, 6>;
    var rem = i;
    for (var d = 5; d >= 0; d = d - 1) {
        let n = pu(GATHER_BACKWARD_DST_SHAPE + u32(d));
        coord[d] = rem % n;
        rem = rem / n;
    }
    // Row-major position of coord in the indices' shape, with coord[dim] counted as 0.
    var base = 0u;
    var stride = 1u;
    var dim_stride = 1u;
    for (var d = 5; d >= 0; d = d - 1) {
        let n = pu(GATHER_BACKWARD_INDICES_SHAPE + u32(d));
        if (u32(d) == dim) {
            dim_stride = stride;
        } else if (coord[d] >= n) {
            dst[i] = bitcast<u32>(0.0);
            return;
        } else {
            base = base + coord[d] * stride;
        }
        stride = stride * n;
    }
    let count = pu(GATHER_BACKWARD_INDICES_SHAPE + dim);
    let src_offset = pu(GATHER_BACKWARD_SRC_OFFSET);
    let indices_offset = pu(GATHER_BACKWARD_INDICES_OFFSET);
    var acc = 0.0;
    for (var j = 0u; j < count; j = j + 1u) {
        let at = base + j * dim_stride;
        if (indices[indices_offset + at] == coord[dim]) {
            acc = acc + bitcast<f32>(src[src_offset + at]);
        }
    }
    dst[i] = bitcast<u32>(acc);
}

// The grad of index_select by scattering: one invocation per element of src (the incoming
// grad, contiguous [outer, selected, inner]) adds it into sums[o, indices[j], i] with a
// compare-and-swap loop on the f32 bits. Work grows with the lookups, not with the table (the
// gather form above costs table size x lookups); the order of the additions, and so the last
// bits of a sum, may differ from run to run.
@compute @workgroup_size(256)
fn index_select_scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(INDEX_SELECT_N)) {
        return;
    }
    let at = table_element(i, picked_row(i));
    if (at == OUTSIDE_WINDOW) {
        return;
    }
    add_to_sum(at, bitcast<f32>(src[pu(INDEX_SELECT_SRC_OFFSET) + i]));
}

// sums[at] += value, as f32 bits, with a compare-and-swap loop (WGSL has no f32 atomics).
fn add_to_sum(at: u32, value: f32) {
    var old = atomicLoad(&sums[at]);
    loop {
        let swapped = atomicCompareExchangeWeak(&sums[at], old, bitcast<u32>(bitcast<f32>(old) + value));
        if (swapped.exchanged) {
            break;
        }
        old = swapped.old_value;
    }
}

// gather_backward by scattering, where the input times the lookups along `dim` is large:
// one invocation per element of src (the incoming grad, contiguous with the indices' shape)
// adds it into sums (the input's shape, zeroed first) at its own coordinates with `dim`
// replaced by its index. Work in the lookups, not input x lookups; the order of the
// additions, and so the last bits of a sum, may differ from run to run.
@compute @workgroup_size(256)
fn gather_scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(GATHER_BACKWARD_N)) {
        return;
    }
    let dim = pu(GATHER_BACKWARD_DIM);
    let picked = indices[pu(GATHER_BACKWARD_INDICES_OFFSET) + i];
    var rem = i;
    var at = 0u;
    var stride = 1u;
    for (var d = 5; d >= 0; d = d - 1) {
        let n = pu(GATHER_BACKWARD_INDICES_SHAPE + u32(d));
        let c = select(rem % n, picked, u32(d) == dim);
        rem = rem / n;
        at = at + c * stride;
        stride = stride * pu(GATHER_BACKWARD_DST_SHAPE + u32(d));
    }
    add_to_sum(at, bitcast<f32>(src[pu(GATHER_BACKWARD_SRC_OFFSET) + i]));
}
