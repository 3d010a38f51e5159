// Casts between dtypes where one side is 16-bit (F16, BF16), and strided copies of 16-bit
// tensors (a cast to the same dtype), through sixteen_bit.wgsl.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;


// SRC_DTYPE and DST_DTYPE are replaced by the host: 0 F32, 1 U32, 2 F16, 3 BF16.
const SRC: u32 = SRC_DTYPEu;
const DST: u32 = DST_DTYPEu;

// Element `i` (row-major over the shape) of the source, as f32.
fn load(i: u32) -> f32 {
    return load_at(pu(CAST_OFFSET) + strided_offset(i, pu(CAST_RANK), CAST_SHAPE, CAST_STRIDES));
}

// The source's element at element offset `at`, as f32.
fn load_at(at: u32) -> f32 {
    if (SRC == 0u) {
        return bitcast<f32>(src[at]);
    }
    if (SRC == 1u) {
        return f32(src[at]);
    }
    return half_to_f32(half_of(src[at / 2u], at), SRC);
}

// The bits `x` is stored as in the destination (16 bits for F16 and BF16).
fn stored(x: f32) -> u32 {
    if (DST == 0u) {
        return bitcast<u32>(x);
    }
    if (DST == 1u) {
        return select(0u, u32(x), x > 0.0); // WGSL saturates at the top; negatives, NaN: 0
    }
    if (DST == 2u) {
        return f32_to_f16(x);
    }
    return f32_to_bf16(x);
}

// Params: `CastParams` (src/ops/cast.rs): `n` elements of the source's layout into the
// contiguous run of the destination from element DST_OFFSET. One invocation per destination
// word: a 32-bit element, or the two 16-bit elements sharing a word, of which it writes those
// in the run and keeps the other's bits (so no two invocations write one word, and a run may
// start or end inside one). A 16-bit element's own bits move unchanged where both sides have
// its dtype (NaN payloads included), through f32 otherwise.
@compute @workgroup_size(256)
fn convert(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let k = workgroup_index(wid, nwg) * 256u + lid;
    let n = pu(CAST_N);
    let first = pu(CAST_DST_OFFSET);
    if (DST < 2u) {
        if (k < n) {
            dst[first + k] = stored(load(k));
        }
        return;
    }
    let w = first / 2u + k;
    if (2u * w >= first + n) {
        return;
    }
    var word = 0u;
    for (var h = 0u; h < 2u; h = h + 1u) {
        let e = 2u * w + h;
        var bits = half_of(dst[w], e);
        if (e >= first && e < first + n) {
            bits = element_bits(e - first);
        }
        word = word | (bits << (16u * h));
    }
    dst[w] = word;
}

// The 16 bits element `i` of the source is stored as in a 16-bit destination.
fn element_bits(i: u32) -> u32 {
    return bits_at(pu(CAST_OFFSET) + strided_offset(i, pu(CAST_RANK), CAST_SHAPE, CAST_STRIDES));
}

// The 16 bits the source's element at element offset `at` is stored as in a 16-bit
// destination.
fn bits_at(at: u32) -> u32 {
    if (SRC == DST) {
        return half_of(src[at / 2u], at);
    }
    return stored(load_at(at));
}

// Params: `CastIntoViewParams`: a 16-bit destination that is a strided view (a slice of the
// last dim, a transposed tensor), its dims ordered by stride, largest first, each stride at
// least the next one's times its size (the host checks), so that an element's position in
// the view's span names at most one index. One invocation per word of the span: of its two
// elements, those the view holds take the source's element at their index, and the others
// keep their bits (no two invocations write one word).
@compute @workgroup_size(256)
fn convert_into_view(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let first = pu(CAST_INTO_VIEW_DST_OFFSET);
    let end = first + pu(CAST_INTO_VIEW_SPAN);
    let w = first / 2u + workgroup_index(wid, nwg) * 256u + lid;
    if (2u * w >= end) {
        return;
    }
    var word = 0u;
    for (var h = 0u; h < 2u; h = h + 1u) {
        let e = 2u * w + h;
        var bits = half_of(dst[w], e);
        if (e >= first && e < end) {
            let at = source_of(e - first);
            if (at != NOT_IN_VIEW) {
                bits = bits_at(at);
            }
        }
        word = word | (bits << (16u * h));
    }
    dst[w] = word;
}

const NOT_IN_VIEW: u32 = 0xffffffffu;

// The source's element offset for the view's element at position `p` of its span, or
// NOT_IN_VIEW where the view holds no element there.
fn source_of(p: u32) -> u32 {
    var rest = p;
    var at = pu(CAST_INTO_VIEW_SRC_OFFSET);
    for (var d = 0u; d < pu(CAST_INTO_VIEW_RANK); d = d + 1u) {
        let i = rest / pu(CAST_INTO_VIEW_DST_STRIDES + d);
        if (i >= pu(CAST_INTO_VIEW_SHAPE + d)) {
            return NOT_IN_VIEW;
        }
        rest = rest - i * pu(CAST_INTO_VIEW_DST_STRIDES + d);
        at = at + i * pu(CAST_INTO_VIEW_SRC_STRIDES + d);
    }
    return select(NOT_IN_VIEW, at, rest == 0u);
}
