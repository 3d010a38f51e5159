// Reductions of an [M, K] strided view along K: sum or max, one template. The host splices
// REDUCE_IDENTITY and the combining expression REDUCE_COMBINE (in `a` and `b`).
// Params: `ReduceParams` (src/ops/reduce.rs).
//
// The input is bound as vec4s so that `serial` can read four elements at a time: software
// adapters pay per load, not per element. A captured step merges consecutive `serial`
// launches into one, repeating the MEMBER SECTION per launch (src/capture/passes/merge.rs).

fn combine(a: f32, b: f32) -> f32 {
    return REDUCE_COMBINE;
}

fn combine4(a: vec4<f32>, b: vec4<f32>) -> vec4<f32> {
    return REDUCE_VEC4_COMBINE;
}

// MEMBER SECTION BEGIN
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

fn src_at(i: u32) -> f32 {
    return src[i / 4u][i % 4u];
}

// One invocation per (row, chunk), looping over the chunk alone. Best when rows are adjacent
// in memory (reducing a leading dim), so neighbouring invocations read neighbouring elements,
// and on CPU adapters, where barriers are costly and each invocation streams through memory.
// Writes dst[row * chunks + chunk]. `wg` is the workgroup. With REDUCE_FOURS an invocation
// takes four adjacent rows (a column sum's four columns) and reads them as one vec4 per step
// along k: a quarter of the loads, which CPU adapters pay for one by one.
fn serial_part(wg: u32, lid: u32) {
    let w = wg * 256u + lid;
    let chunks = pu(REDUCE_CHUNKS);
    let fours = pu(REDUCE_FOURS) == 1u;
    let rows_per = select(1u, 4u, fours);
    if (w >= pu(REDUCE_ROWS) / rows_per * chunks) {
        return;
    }
    let row = (w / chunks) * rows_per;
    let chunk = w % chunks;
    let start = chunk * pu(REDUCE_CHUNK_LEN);
    let end = min(start + pu(REDUCE_CHUNK_LEN), pu(REDUCE_LEN));
    let base = pu(REDUCE_OFFSET) + row * pu(REDUCE_ROW_STRIDE);
    let ks = pu(REDUCE_K_STRIDE);
    let scale = pf(REDUCE_SCALE);
    var k = start;
    if (fours) {
        var acc4 = vec4<f32>(REDUCE_IDENTITY);
        for (; k < end; k = k + 1u) {
            acc4 = combine4(acc4, src[(base + k * ks) / 4u]);
        }
        let o = row * chunks + chunk;
        dst[o] = acc4.x * scale;
        dst[o + chunks] = acc4.y * scale;
        dst[o + 2u * chunks] = acc4.z * scale;
        dst[o + 3u * chunks] = acc4.w * scale;
        return;
    }
    var acc = REDUCE_IDENTITY;
    if (pu(REDUCE_VEC4) == 1u) {
        var acc4 = vec4<f32>(REDUCE_IDENTITY);
        for (; k + 4u <= end; k = k + 4u) {
            acc4 = combine4(acc4, src[(base + k) / 4u]);
        }
        acc = combine(combine(acc4.x, acc4.y), combine(acc4.z, acc4.w));
    }
    for (; k < end; k = k + 1u) {
        acc = combine(acc, src_at(base + k * ks));
    }
    dst[w] = acc * scale;
}
// MEMBER SECTION END

var<workgroup> partial: array<f32, 256>;

// What (row, chunk) `item` of a `rows` or `subgroup_rows` pass reads: the elements
// base + k * k_stride for k from start to end.
struct Chunk {
    base: u32,
    k_stride: u32,
    start: u32,
    end: u32,
}

fn chunk_of(item: u32) -> Chunk {
    let chunks = pu(REDUCE_CHUNKS);
    let start = (item % chunks) * pu(REDUCE_CHUNK_LEN);
    let base = pu(REDUCE_OFFSET) + (item / chunks) * pu(REDUCE_ROW_STRIDE);
    return Chunk(base, pu(REDUCE_K_STRIDE), start, min(start + pu(REDUCE_CHUNK_LEN), pu(REDUCE_LEN)));
}

// One workgroup per (row, chunk): 256 invocations stride through the chunk, then combine in a
// tree. Writes dst[row * chunks + chunk]. The GPU flavour's reduction where the device has no
// subgroups (else subgroup_rows).
@compute @workgroup_size(256)
fn rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = workgroup_index(wid, nwg);
    // Uniform across the workgroup, so the early return cannot split a barrier.
    if (w >= pu(REDUCE_ROWS) * pu(REDUCE_CHUNKS)) {
        return;
    }
    let c = chunk_of(w);
    var acc = REDUCE_IDENTITY;
    for (var k = c.start + lid; k < c.end; k = k + 256u) {
        acc = combine(acc, src_at(c.base + k * c.k_stride));
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var width = 128u; width > 0u; width = width / 2u) {
        if (lid < width) {
            partial[lid] = combine(partial[lid], partial[lid + width]);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        dst[w] = partial[0] * pf(REDUCE_SCALE);
    }
}

// SUBGROUP SECTION BEGIN: kept only where the device has subgroups of a fixed width.
// `v` combined over the lanes of a subgroup `width` wide, by butterfly shuffles through
// `combine` (so max keeps propagating NaN, which subgroupMax need not): every lane gets it.
fn subgroup_combine(v: f32, width: u32) -> f32 {
    var s = v;
    for (var lane_mask = 1u; lane_mask < width; lane_mask = lane_mask * 2u) {
        s = combine(s, subgroupShuffleXor(s, lane_mask));
    }
    return s;
}

// One subgroup per (row, chunk): the lanes stride through the chunk (neighbouring lanes read
// neighbouring elements of a contiguous row), combine by shuffles, and the first lane writes
// dst[row * chunks + chunk]. No workgroup memory and no barrier: the GPU flavour's reduction
// where the device has subgroups (the subgroups of a one-dimensional workgroup hold consecutive
// invocations, as on every adapter wgrad knows). A workgroup takes 32 items, one per subgroup
// of 8 lanes; its subgroups step through them whatever their width, which a driver may pick per
// shader (row_group.wgsl).
@compute @workgroup_size(256)
fn subgroup_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32,
                 @builtin(subgroup_invocation_id) lane: u32,
                 @builtin(subgroup_size) width: u32) {
    let first = workgroup_index(wid, nwg) * 32u;
    let end = min(first + 32u, pu(REDUCE_ROWS) * pu(REDUCE_CHUNKS));
    // The same for every lane of a subgroup, so the loop cannot split a shuffle.
    for (var item = first + lid / width; item < end; item = item + max(256u / width, 1u)) {
        let c = chunk_of(item);
        var acc = REDUCE_IDENTITY;
        for (var k = c.start + lane; k < c.end; k = k + width) {
            acc = combine(acc, src_at(c.base + k * c.k_stride));
        }
        let total = subgroup_combine(acc, width);
        if (lane == 0u) {
            dst[item] = total * pf(REDUCE_SCALE);
        }
    }
}
// SUBGROUP SECTION END

@compute @workgroup_size(256)
fn serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    serial_part(workgroup_index(wid, nwg), lid);
}
