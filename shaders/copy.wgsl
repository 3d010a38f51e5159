// Data movement: strided copies (contiguous, cat, reshape of a view) and fills. Elements are
// moved as raw 32-bit words, so one kernel serves f32 and u32 tensors.

// WORD is u32, or vec4<u32> where the host counts the layout in groups of four words.
@group(0) @binding(1) var<storage, read> src: array<WORD>;
@group(0) @binding(2) var<storage, read_write> dst: array<WORD>;

// Params: `CopyParams` (src/ops/copy.rs), in WORDs. Each invocation copies the items
// `contiguous_item(.., j, ..)` for j < 64, which run 8 items apart. It decomposes its first
// item's index into coordinates once and then steps them like an odometer, carrying into the
// outer dims, so the loop divides nothing: CPU adapters divide each lane on its own, and
// recomputing the offsets where a step crossed a row's end (every 4 elements of attention's
// 32-wide head rows) made the copy 7x slower per element than an add.
@compute @workgroup_size(256)
fn strided_copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let n = pu(COPY_N);
    let first = pu(COPY_FIRST);
    let dims = copy_layout();
    var i = contiguous_item(wid, nwg, lid, 0u, CONTIGUOUS_PER_GROUP);
    var at = copy_start(first + i, dims);
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        if (i >= n) {
            break;
        }
        dst[at.dst] = src[at.src];
        i = i + 8u;
        at = copy_step(at, dims);
    }
}

// The six dims of a copy (sizes, source and destination strides, innermost last) and where
// each side starts.
struct CopyLayout {
    shape: array<u32, 6>,
    src: array<u32, 6>,
    dst: array<u32, 6>,
    src_offset: u32,
    dst_offset: u32,
}

fn copy_layout() -> CopyLayout {
    var l: CopyLayout;
    l.shape = array<u32, 6>(pu(COPY_SHAPE), pu(COPY_SHAPE + 1u), pu(COPY_SHAPE + 2u),
                            pu(COPY_SHAPE + 3u), pu(COPY_SHAPE + 4u), pu(COPY_SHAPE + 5u));
    l.src = array<u32, 6>(pu(COPY_SRC_STRIDES), pu(COPY_SRC_STRIDES + 1u), pu(COPY_SRC_STRIDES + 2u),
                          pu(COPY_SRC_STRIDES + 3u), pu(COPY_SRC_STRIDES + 4u), pu(COPY_SRC_STRIDES + 5u));
    l.dst = array<u32, 6>(pu(COPY_DST_STRIDES), pu(COPY_DST_STRIDES + 1u), pu(COPY_DST_STRIDES + 2u),
                          pu(COPY_DST_STRIDES + 3u), pu(COPY_DST_STRIDES + 4u), pu(COPY_DST_STRIDES + 5u));
    l.src_offset = pu(COPY_SRC_OFFSET);
    l.dst_offset = pu(COPY_DST_OFFSET);
    return l;
}

// An element's coordinates in the six dims and its (source, destination) offsets.
struct CopyAt {
    c: array<u32, 6>,
    src: u32,
    dst: u32,
}

// Where element `i` (row-major over the shape) lies. Constant indices only, so that everything
// stays in registers.
fn copy_start(i: u32, l: CopyLayout) -> CopyAt {
    var at: CopyAt;
    var rem = i;
    at.c[5] = rem % l.shape[5];
    rem = rem / l.shape[5];
    at.c[4] = rem % l.shape[4];
    rem = rem / l.shape[4];
    at.c[3] = rem % l.shape[3];
    rem = rem / l.shape[3];
    at.c[2] = rem % l.shape[2];
    rem = rem / l.shape[2];
    at.c[1] = rem % l.shape[1];
    at.c[0] = rem / l.shape[1];
    at.src = l.src_offset;
    at.dst = l.dst_offset;
    at.src = at.src + at.c[0] * l.src[0] + at.c[1] * l.src[1] + at.c[2] * l.src[2];
    at.src = at.src + at.c[3] * l.src[3] + at.c[4] * l.src[4] + at.c[5] * l.src[5];
    at.dst = at.dst + at.c[0] * l.dst[0] + at.c[1] * l.dst[1] + at.c[2] * l.dst[2];
    at.dst = at.dst + at.c[3] * l.dst[3] + at.c[4] * l.dst[4] + at.c[5] * l.dst[5];
    return at;
}

// `at` moved 8 elements on: the innermost coordinate steps by 8, each time it passes the end
// of its dim one is carried into the next dim out, and so on outwards. No division. A
// coordinate other than the innermost reaches its dim's size only right after a carry into
// it, so each outer dim is checked once, in order.
fn copy_step(prev: CopyAt, l: CopyLayout) -> CopyAt {
    var at = prev;
    at.c[5] = at.c[5] + 8u;
    at.src = at.src + 8u * l.src[5];
    at.dst = at.dst + 8u * l.dst[5];
    for (var guard = 0u; guard < rolled(8u) && at.c[5] >= l.shape[5]; guard = guard + 1u) {
        at = carry(at, l, 5u);
        if (at.c[4] == l.shape[4]) {
            at = carry(at, l, 4u);
        }
        if (at.c[3] == l.shape[3]) {
            at = carry(at, l, 3u);
        }
        if (at.c[2] == l.shape[2]) {
            at = carry(at, l, 2u);
        }
        if (at.c[1] == l.shape[1]) {
            at = carry(at, l, 1u);
        }
    }
    return at;
}

// `at` with one whole run of dim `k` (1 to 5) taken off and one step of dim k - 1 added.
// Called with constant `k` only: once inlined, every index is constant and the coordinates
// stay in registers.
fn carry(prev: CopyAt, l: CopyLayout, k: u32) -> CopyAt {
    var at = prev;
    at.c[k] = at.c[k] - l.shape[k];
    at.c[k - 1u] = at.c[k - 1u] + 1u;
    at.src = at.src - l.shape[k] * l.src[k] + l.src[k - 1u];
    at.dst = at.dst - l.shape[k] * l.dst[k] + l.dst[k - 1u];
    return at;
}
