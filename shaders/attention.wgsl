// Scaled dot-product attention, fused: softmax(q k^T * scale) v without storing the Tq x Tk
// scores. The forward keeps a running max and sum per query row (online softmax, as
// flash-attention) and saves each row's log-sum-exp; the backward recomputes the scores from
// it. Params: `AttentionParams` (src/ops/attention.rs). Head h (of batch x heads) has Tq
// query rows and Tk key rows; q, k, v and the out grad are read in place through their
// strides (a head's rows start at offset + (h / inner_len) outer_stride + (h % inner_len)
// inner_stride, rows row_stride apart, features adjacent), and the outputs (the forward's,
// the query and key grads, the value grad) are written through such strides too: the host
// lays each out in the order of the input it follows, so that a [B, T, H, D] memory order
// stays one and merging the heads back is a view. ALIGNED (offsets and strides multiples of
// 4, D and Dv too) reads four features per load.
//
// Four sets of entries do this (`Entries` in src/ops/attention.rs picks one per device): the
// plain ones below, the `*_tiled` ones (FLASH TILES, the GPU kernel flavour without
// subgroups), the `*_shared` ones (SUBGROUP SECTION, CPU adapters with 8-wide subgroups) and
// the `*_tiled_lanes` ones (LANE TILES, the GPU kernel flavour with subgroups of 8 or more
// lanes). In the plain ones
// one invocation owns one query row (forward, query grad) or one key row (key and value
// grads) and loops over the other side in spans of `span` rows, so that no invocation runs
// more loop iterations than llvmpipe allows (65,535). The forward runs its `splits` spans in
// parallel invocations and `combine` joins them; the backward runs one span per launch, each
// adding to what the earlier ones wrote, so its grads need no per-split copies. Rows are
// read four features at a time, zero-padded past the row's end.

@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<f32>>;
// forward: out [splits, rows, dv] (normalised when splits == 1, else the unnormalised sums).
// backward: the out grad.
@group(0) @binding(4) var<storage, read_write> o: array<vec4<f32>>;
// forward: [splits, rows, 2] running (max, sum), or [rows, 2] (log-sum-exp, 0) when
// splits == 1. backward: [rows, 2] (log-sum-exp, rowsum(out grad * out)).
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
// query grad (rows like q's); key grad (like k's). Through the out layout.
@group(0) @binding(6) var<storage, read_write> grad_a: array<vec4<f32>>;
// value grad (rows like v's), through the second out layout.
@group(0) @binding(7) var<storage, read_write> grad_b: array<vec4<f32>>;
// The mask, read through the mask layout (see `masked_score`); any buffer when there is none.
@group(0) @binding(8) var<storage, read> mask: array<f32>;

// What the mask is: 0 none, 1 an F32 mask added to the scores, 2 a U32 keep-mask (nonzero:
// attend). Spliced in per call, so that the unmasked kernels read no mask.
const MASK_KIND: u32 = MASK_CODEu;

// Four-feature groups per q/k row and per v row: spliced in per head size, so the row arrays
// below are exactly that long (a fixed maximum of 64 made LLVM compile for seconds). Their
// loops are bounded by the same counts read at run time (`d4`, `dv4`), which keeps them
// rolled: with constant bounds LLVM unrolled them and the three kernels of a head of 32
// took 2 s to compile instead of 0.8 s, and ran no faster.
const D4: u32 = HEAD_VEC4Su;
const DV4: u32 = VALUE_VEC4Su;

// The same counts padded to whole 8s: the rows of the tiles, and the register rows of the
// `*_shared` and `*_tiled_lanes` entries, zero past a row's end, so that 8 lanes sharing a
// row's groups need no bounds.
const D8: u32 = (D4 + 7u) / 8u * 8u;
const DV8: u32 = (DV4 + 7u) / 8u * 8u;

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}

// The score of query `i` of q head `h` against key `j`, with the mask applied: plus the F32
// mask, or -inf where the keep-mask is 0. Every caller skips a key whose score is -inf (its
// weight is 0), so a row whose keys are all masked has output 0 and no grad, as a causal row
// with no key. The mask layout is (offset, outer stride, inner stride, inner len, row stride,
// key stride) over q's heads, strides 0 where the mask broadcasts.
fn masked_score(score: f32, h: u32, i: u32, j: u32) -> f32 {
    if (MASK_KIND == 0u) {
        return score;
    }
    let at = head_start(h, ATTENTION_MASK_LAYOUT) + i * pu(ATTENTION_MASK_LAYOUT + 4u) + j * pu(ATTENTION_MASK_LAYOUT + 5u);
    if (MASK_KIND == 1u) {
        return score + mask[at];
    }
    return select(neg_inf(), score, bitcast<u32>(mask[at]) != 0u);
}

// The k and v head that q head `h` reads: grouped-query attention shares each k/v head
// among `group` consecutive q heads (group 1 without).
fn kv_head(h: u32) -> u32 {
    return h / pu(ATTENTION_GROUP);
}

// True for the lanes of features i..i+4 inside a row of `len`.
fn inside(i: u32, len: u32) -> vec4<bool> {
    return vec4<u32>(i) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(len);
}

// Where head `h`'s first row starts, for a tensor whose layout params start at `at` (offset,
// outer stride, inner stride, inner len, row stride).
fn head_start(h: u32, at: u32) -> u32 {
    let inner_len = pu(at + 3u);
    return pu(at) + (h / inner_len) * pu(at + 1u) + (h % inner_len) * pu(at + 2u);
}

// Where row `r` of head `h` starts, for a tensor whose layout params start at `at`.
fn row_start(h: u32, r: u32, at: u32) -> u32 {
    return head_start(h, at) + r * pu(at + 4u);
}

// Vec4 `i` of the input bound as `side` (0 q, 1 k, 2 v, 3 o): one loader for the four, each
// call site's `side` a constant (a function cannot take a storage buffer). An entry that
// reads through it binds all four.
fn word(side: u32, i: u32) -> vec4<f32> {
    switch side {
        case 0u: { return q[i]; }
        case 1u: { return k[i]; }
        case 2u: { return v[i]; }
        default: { return o[i]; }
    }
}

// Features 4c..4c+4 of the row of `side` starting at element `at`, zero past `len`.
fn row4(side: u32, at: u32, c: u32, len: u32) -> vec4<f32> {
    let i = at + 4u * c;
    if (ALIGNED) {
        return word(side, i / 4u);
    }
    let e = vec4<f32>(word(side, i / 4u)[i % 4u], word(side, (i + 1u) / 4u)[(i + 1u) % 4u],
                      word(side, (i + 2u) / 4u)[(i + 2u) % 4u], word(side, (i + 3u) / 4u)[(i + 3u) % 4u]);
    // Selected, not multiplied by 0: the words past a row's end may hold anything (the next
    // tensor's bytes, a pooled buffer's leftovers), NaN and infinity included.
    return select(vec4<f32>(0.0), e, inside(4u * c, len));
}

fn q4(at: u32, c: u32, len: u32) -> vec4<f32> {
    return row4(0u, at, c, len);
}

fn k4(at: u32, c: u32, len: u32) -> vec4<f32> {
    return row4(1u, at, c, len);
}

fn v4(at: u32, c: u32, len: u32) -> vec4<f32> {
    return row4(2u, at, c, len);
}

// The out grad (bound at `o` in the backward).
fn dout4(at: u32, c: u32, len: u32) -> vec4<f32> {
    return row4(3u, at, c, len);
}

// Element `i` of the vec4 arrays, one at a time (the combine pass and the forward's stores).
fn v_at(i: u32) -> f32 {
    return v[i / 4u][i % 4u];
}

fn k_at(i: u32) -> f32 {
    return k[i / 4u][i % 4u];
}

// Keys [first, last) that query `i` (of Tq) attends to in split `s`.
fn key_range(i: u32, s: u32) -> vec2<u32> {
    let span = pu(ATTENTION_SPAN);
    var end = pu(ATTENTION_T_K);
    if (pu(ATTENTION_CAUSAL) == 1u) {
        end = min(end, i + 1u);
    }
    return vec2<u32>(min(s * span, end), min((s + 1u) * span, end));
}

// Queries [first, last) that attend to key `j` in split `s`.
fn query_range(j: u32, s: u32) -> vec2<u32> {
    let span = pu(ATTENTION_SPAN);
    let t_q = pu(ATTENTION_T_Q);
    var first = s * span;
    if (pu(ATTENTION_CAUSAL) == 1u) {
        first = max(first, j);
    }
    return vec2<u32>(min(first, t_q), min((s + 1u) * span, t_q));
}

// How many of features 4c..4c+4 lie inside a row of `len` (each entry stores only those, one
// loop per output buffer: a kernel may only name the buffers its entry point binds).
fn lanes(c: u32, len: u32) -> u32 {
    return min(4u, len - 4u * c);
}

// The head sizes and the score scale, as the params give them: features per q/k row (`d`)
// and per v row (`dv`), and their four-feature groups, which bound the row loops.
struct Sizes {
    d: u32,
    d4: u32,
    dv: u32,
    dv4: u32,
    scale: f32,
}

fn sizes() -> Sizes {
    let d = pu(ATTENTION_D);
    let dv = pu(ATTENTION_DV);
    return Sizes(d, (d + 3u) / 4u, dv, (dv + 3u) / 4u, pf(ATTENTION_SCALE));
}

// Where the k and v rows that q head `h` reads start, and how far apart their rows are.
struct KeyValueRows {
    k_head: u32,
    k_rs: u32,
    v_head: u32,
    v_rs: u32,
}

fn key_value_rows(h: u32) -> KeyValueRows {
    return KeyValueRows(head_start(kv_head(h), ATTENTION_K_LAYOUT), pu(ATTENTION_K_LAYOUT + 4u),
                        head_start(kv_head(h), ATTENTION_V_LAYOUT), pu(ATTENTION_V_LAYOUT + 4u));
}

// Where the forward writes query row `row` (row `i` of head `h`) of split `s`: the output
// when there is one split, else that split's partial sums.
fn forward_out_start(row: u32, h: u32, i: u32, s: u32) -> u32 {
    let partial = (s * pu(ATTENTION_ROWS) + row) * pu(ATTENTION_DV);
    return select(partial, row_start(h, i, ATTENTION_OUT_LAYOUT), pu(ATTENTION_SPLITS) == 1u);
}

// What the forward scales a row's sums by: 1 / l for a whole row (a row with no key, causal
// with Tq > Tk, has l = 0 and output 0, as 0 / 0 would not be), 1 for a split's partial sums.
fn forward_out_scale(l: f32) -> f32 {
    return select(1.0, select(0.0, 1.0 / l, l > 0.0), pu(ATTENTION_SPLITS) == 1u);
}

// The forward's stats of query row `row` in split `s`: (log-sum-exp, 0) of a whole row, else
// the split's running (max, sum).
fn store_forward_stats(row: u32, s: u32, m: f32, l: f32) {
    if (pu(ATTENTION_SPLITS) == 1u) {
        stats[2u * row] = m + log(l);
        stats[2u * row + 1u] = 0.0;
        return;
    }
    let at = 2u * (s * pu(ATTENTION_ROWS) + row);
    stats[at] = m;
    stats[at + 1u] = l;
}

// Writes the first `n` features of `value` to o from element `at` (one vec4 where aligned).
fn store_out(at: u32, value: vec4<f32>, n: u32) {
    if (ALIGNED) {
        o[at / 4u] = value;
        return;
    }
    for (var e = 0u; e < n; e = e + 1u) {
        o[(at + e) / 4u][(at + e) % 4u] = value[e];
    }
}

// Writes the first `n` features of `value` to grad_a (grad_b) from element `at`, added to what
// is there when `add` (a later split): one vec4 where aligned (`n` is 4 there). Element by
// element, each access is a site that lavapipe compiles as a loop over its lanes.
fn add_grad_a(at: u32, value: vec4<f32>, n: u32, add: bool) {
    if (ALIGNED) {
        grad_a[at / 4u] = select(value, grad_a[at / 4u] + value, add);
        return;
    }
    for (var e = 0u; e < n; e = e + 1u) {
        let i = at + e;
        grad_a[i / 4u][i % 4u] = select(value[e], grad_a[i / 4u][i % 4u] + value[e], add);
    }
}

// Where the value grads go: through grad_b, or (VALUE_GRAD_SHARED) through grad_a, whose
// buffer then holds the key and the value grads both, as the packed projection q, k and v
// came from does (`packed_grads` in src/ops/attention.rs). Two writable bindings of one buffer
// would alias, which WebGPU forbids; grad_b is then bound to a scratch buffer, unwritten.
const VALUE_GRAD_SHARED: bool = VALUE_GRAD_SHARED_CODE;

fn add_grad_b(at: u32, value: vec4<f32>, n: u32, add: bool) {
    if (VALUE_GRAD_SHARED) {
        add_grad_a(at, value, n, add);
        return;
    }
    if (ALIGNED) {
        grad_b[at / 4u] = select(value, grad_b[at / 4u] + value, add);
        return;
    }
    for (var e = 0u; e < n; e = e + 1u) {
        let i = at + e;
        grad_b[i / 4u][i % 4u] = select(value[e], grad_b[i / 4u][i % 4u] + value[e], add);
    }
}

// Writes a register row of q/k features to grad_a from element `at`, added to what is there
// when `add`.
fn store_grad_a_row(row: ptr<function, array<vec4<f32>, D4>>, at: u32, z: Sizes, add: bool) {
    for (var c = 0u; c < z.d4; c = c + 1u) {
        add_grad_a(at + 4u * c, (*row)[c], lanes(c, z.d), add);
    }
}

// The dot product of a register row of q/k features with the row of `side` at `at`.
fn dot_row(row: ptr<function, array<vec4<f32>, D4>>, side: u32, at: u32, z: Sizes) -> f32 {
    var sum = 0.0;
    for (var c = 0u; c < z.d4; c = c + 1u) {
        sum = sum + dot((*row)[c], row4(side, at, c, z.d));
    }
    return sum;
}

// The row (of `rows`) and the split of its loop that invocation `lid` of workgroup `wid`
// owns, and where that row lies: row `i` of head `h`, each head having `t` rows; not valid
// past the last. A forward runs its splits side by side (`split` param 0); a backward runs
// one per launch (`splits` param 1), the one the `split` param names.
struct Owned {
    row: u32,
    h: u32,
    i: u32,
    split: u32,
    valid: bool,
}

fn owned_row(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, t: u32) -> Owned {
    let g = workgroup_index(wid, nwg) * 64u + lid;
    let rows = pu(ATTENTION_ROWS);
    let row = g % rows;
    return Owned(row, row / t, row % t, g / rows + pu(ATTENTION_SPLIT), g < rows * pu(ATTENTION_SPLITS));
}

@compute @workgroup_size(64)
fn forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = owned_row(wid, nwg, lid, pu(ATTENTION_T_Q));
    if (!row.valid) {
        return;
    }
    let z = sizes();
    let kv = key_value_rows(row.h);
    var query: array<vec4<f32>, D4>;
    for (var c = 0u; c < z.d4; c = c + 1u) {
        query[c] = q4(row_start(row.h, row.i, ATTENTION_Q_LAYOUT), c, z.d) * z.scale;
    }
    var acc: array<vec4<f32>, DV4>; // zero, as every var without an initialiser
    var m = neg_inf();
    var l = 0.0;
    let keys = key_range(row.i, row.split);
    for (var j = keys.x; j < keys.y; j = j + 1u) {
        let score = masked_score(dot_row(&query, 1u, kv.k_head + j * kv.k_rs, z), row.h, row.i, j);
        if (score == neg_inf()) {
            continue;
        }
        let m_new = max(m, score);
        let correction = exp(m - m_new);
        let p = exp(score - m_new);
        l = l * correction + p;
        for (var c = 0u; c < z.dv4; c = c + 1u) {
            acc[c] = acc[c] * correction + p * v4(kv.v_head + j * kv.v_rs, c, z.dv);
        }
        m = m_new;
    }
    let out_base = forward_out_start(row.row, row.h, row.i, row.split);
    for (var c = 0u; c < z.dv4; c = c + 1u) {
        store_out(out_base + 4u * c, acc[c] * forward_out_scale(l), lanes(c, z.dv));
    }
    store_forward_stats(row.row, row.split, m, l);
}

// Joins the splits of `forward`: one invocation per query row. Reads the partial sums from
// `v` ([splits, rows, dv]) and the running stats from `k` ([splits, rows, 2]); writes the
// output to `o` and (log-sum-exp, 0) to `stats`.
@compute @workgroup_size(64)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 64u + lid;
    let rows = pu(ATTENTION_ROWS);
    if (row >= rows) {
        return;
    }
    let splits = pu(ATTENTION_SPLITS);
    let dv = pu(ATTENTION_DV);
    let dv4 = (dv + 3u) / 4u;
    var m = bitcast<f32>(0xff800000u);
    for (var s = 0u; s < splits; s = s + 1u) {
        m = max(m, k_at(2u * (s * rows + row)));
    }
    var l = 0.0;
    for (var s = 0u; s < splits; s = s + 1u) {
        let at = 2u * (s * rows + row);
        l = l + k_at(at + 1u) * select(0.0, exp(k_at(at) - m), k_at(at + 1u) > 0.0);
    }
    let inv = select(0.0, 1.0 / l, l > 0.0);
    let t_q = pu(ATTENTION_T_Q);
    let out_base = row_start(row / t_q, row % t_q, ATTENTION_OUT_LAYOUT);
    for (var c = 0u; c < dv; c = c + 1u) {
        var sum = 0.0;
        for (var s = 0u; s < splits; s = s + 1u) {
            let at = 2u * (s * rows + row);
            sum = sum + v_at((s * rows + row) * dv + c) * select(0.0, exp(k_at(at) - m), k_at(at + 1u) > 0.0);
        }
        let out_at = out_base + c;
        o[out_at / 4u][out_at % 4u] = sum * inv;
    }
    stats[2u * row] = m + log(l);
    stats[2u * row + 1u] = 0.0;
}

// The backward's stats of each query row, (log-sum-exp, delta = dout_i . out_i): one
// invocation per row. Reads the forward's stats from `k`, the output from `v` through the v
// layout and the out grad from `o` through the o layout; writes `stats`.
@compute @workgroup_size(64)
fn backward_stats(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 64u + lid;
    if (row >= pu(ATTENTION_ROWS)) {
        return;
    }
    let t_q = pu(ATTENTION_T_Q);
    let h = row / t_q;
    let dv = pu(ATTENTION_DV);
    let o_at = row_start(h, row % t_q, ATTENTION_O_LAYOUT);
    let out_at = row_start(h, row % t_q, ATTENTION_V_LAYOUT);
    var delta = 0.0;
    for (var c = 0u; c < (dv + 3u) / 4u; c = c + 1u) {
        delta = delta + dot(dout4(o_at, c, dv), v4(out_at, c, dv));
    }
    stats[2u * row] = k_at(2u * row);
    stats[2u * row + 1u] = delta;
}

// The query grad: dq_i = scale * sum_j p_ij (dout_i . v_j - delta_i) k_j, where
// p_ij = exp(scale q_i . k_j - lse_i) and delta_i = dout_i . out_i.
@compute @workgroup_size(64)
fn backward_query(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let query_row = owned_row(wid, nwg, lid, pu(ATTENTION_T_Q));
    let z = sizes();
    if (!query_row.valid) {
        return;
    }
    let h = query_row.h;
    let i = query_row.i;
    // Each launch after a row's first split adds to the grads the earlier ones wrote (a row
    // is one invocation's alone, so no race).
    let s = query_row.split;
    let kv = key_value_rows(h);
    var query: array<vec4<f32>, D4>;
    for (var c = 0u; c < z.d4; c = c + 1u) {
        query[c] = q4(row_start(h, i, ATTENTION_Q_LAYOUT), c, z.d) * z.scale;
    }
    var dout: array<vec4<f32>, DV4>;
    for (var c = 0u; c < z.dv4; c = c + 1u) {
        dout[c] = dout4(row_start(h, i, ATTENTION_O_LAYOUT), c, z.dv);
    }
    var grad: array<vec4<f32>, D4>;
    let lse = stats[2u * query_row.row];
    let delta = stats[2u * query_row.row + 1u];
    let keys = key_range(i, s);
    for (var j = keys.x; j < keys.y; j = j + 1u) {
        let k_row = kv.k_head + j * kv.k_rs;
        let score = masked_score(dot_row(&query, 1u, k_row, z), h, i, j);
        if (score == neg_inf()) {
            continue;
        }
        var dp = 0.0;
        for (var c = 0u; c < z.dv4; c = c + 1u) {
            dp = dp + dot(dout[c], v4(kv.v_head + j * kv.v_rs, c, z.dv));
        }
        let ds = exp(score - lse) * (dp - delta) * z.scale;
        for (var c = 0u; c < z.d4; c = c + 1u) {
            grad[c] = grad[c] + ds * k4(k_row, c, z.d);
        }
    }
    store_grad_a_row(&grad, row_start(h, i, ATTENTION_OUT_LAYOUT), z, s > 0u);
}

// The key and value grads: dk_j = scale * sum_i p_ij (dout_i . v_j - delta_i) q_i and
// dv_j = sum_i p_ij dout_i, the sums over the queries of every q head that reads this k/v
// head (`group` of them). `rows` counts key rows here.
@compute @workgroup_size(64)
fn backward_key(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let key_row = owned_row(wid, nwg, lid, pu(ATTENTION_T_K));
    if (!key_row.valid) {
        return;
    }
    let h = key_row.h;
    let j = key_row.i;
    let s = key_row.split; // as in backward_query
    let z = sizes();
    let q_rs = pu(ATTENTION_Q_LAYOUT + 4u);
    let o_rs = pu(ATTENTION_O_LAYOUT + 4u);
    let group = pu(ATTENTION_GROUP);
    var value: array<vec4<f32>, DV4>;
    for (var c = 0u; c < z.dv4; c = c + 1u) {
        value[c] = v4(row_start(h, j, ATTENTION_V_LAYOUT), c, z.dv);
    }
    var key: array<vec4<f32>, D4>;
    for (var c = 0u; c < z.d4; c = c + 1u) {
        key[c] = k4(row_start(h, j, ATTENTION_K_LAYOUT), c, z.d) * z.scale;
    }
    var grad_key: array<vec4<f32>, D4>;
    var grad_value: array<vec4<f32>, DV4>;
    let queries = query_range(j, s);
    for (var hq = h * group; hq < (h + 1u) * group; hq = hq + 1u) {
        let q_head = head_start(hq, ATTENTION_Q_LAYOUT);
        let o_head = head_start(hq, ATTENTION_O_LAYOUT);
        for (var i = queries.x; i < queries.y; i = i + 1u) {
            let q_row = q_head + i * q_rs;
            let stat = 2u * (hq * t_q + i);
            let score = masked_score(dot_row(&key, 0u, q_row, z), hq, i, j);
            if (score == neg_inf()) {
                continue;
            }
            let p = exp(score - stats[stat]);
            var dp = 0.0;
            for (var c = 0u; c < z.dv4; c = c + 1u) {
                let g = dout4(o_head + i * o_rs, c, z.dv);
                dp = dp + dot(g, value[c]);
                grad_value[c] = grad_value[c] + p * g;
            }
            let ds = p * (dp - stats[stat + 1u]) * z.scale;
            for (var c = 0u; c < z.d4; c = c + 1u) {
                grad_key[c] = grad_key[c] + ds * q4(q_row, c, z.d);
            }
        }
    }
    store_grad_a_row(&grad_key, row_start(h, j, ATTENTION_OUT_LAYOUT), z, s > 0u);
    for (var c = 0u; c < z.dv4; c = c + 1u) {
        add_grad_b(row_start(h, j, ATTENTION_OUT2_LAYOUT) + 4u * c, grad_value[c], lanes(c, z.dv), s > 0u);
    }
}

// FLASH TILES: the `*_tiled` entries do what the entries above do, for a workgroup that owns
// 64 consecutive rows of one head (each head's rows padded to whole 64s; the padding's
// invocations stage tiles with the rest and store nothing), as flash-attention does: the
// workgroup walks the other side in tiles of `TILE` rows, which its 64 invocations stage in
// workgroup memory together. Each row of the other side is then read from storage once per
// 64 rows instead of once per row, and all 64 read a tile's row at the same index (one
// broadcast). The loop ends at the workgroup's last row's last key, so causal tiles past the
// diagonal are skipped; inside a tile each row gives the keys outside its own range weight 0
// with selects, not a `continue`: a branch that differs between invocations would make the
// loop's counter differ too as a compiler sees it. The feature loops have constant bounds
// (`D4`, `DV4`), unlike the entries above, so that a GPU compiler unrolls them and keeps the
// register rows in registers (rolled, with the rows in memory, they ran 2x slower on
// lavapipe; unrolled, a head of 128 takes lavapipe seconds to compile). The GPU kernel flavour
// runs these (`Entries::Tiled` in src/ops/attention.rs).

// Rows per tile, spliced in per head size: as many as fit the two tiles in 16 KiB (the least
// workgroup memory an adapter has), at most 64.
const TILE: u32 = TILE_ROWSu;

// The tile of q/k rows (forward and query grad: keys; key grads: queries) and the tile of v
// rows (forward and query grad: values; key grads: out grad rows), `D8` and `DV8` feature
// groups to a row, zero past the row's `D4` (`DV4`).
var<workgroup> tile_a: array<vec4<f32>, TILE * D8>;
var<workgroup> tile_b: array<vec4<f32>, TILE * DV8>;

// The rows a workgroup owns: rows first..=last of head `h`, where each head's `t` rows are
// padded to whole 64s; from the workgroup's id alone, so that every loop around a barrier has
// the same bounds in all 64 invocations, as WGSL requires.
struct HeadBlock {
    h: u32,
    first: u32,
    last: u32,
    split: u32,
    valid: bool,
}

fn head_block(wid: vec3<u32>, nwg: vec3<u32>, t: u32) -> HeadBlock {
    let padded = (t + 63u) / 64u * 64u;
    let per_split = (pu(ATTENTION_ROWS) / t) * padded;
    let g = workgroup_index(wid, nwg) * 64u;
    let p = g % per_split;
    let first = p % padded;
    let split = g / per_split + pu(ATTENTION_SPLIT);
    return HeadBlock(p / padded, first, min(first + 63u, t - 1u), split, g < per_split * pu(ATTENTION_SPLITS));
}

// Stages `n` rows into the tiles, each invocation a share of the feature groups: into
// `tile_a` the rows of `a_side` from element `a_at`, `a_rs` apart (`D8` groups to a row), into
// `tile_b` those of `b_side` from `b_at`, `b_rs` apart (`DV8` groups), zero past each row's
// end. Rows past `n` are left as they are (no loop reads them).
fn stage_tiles(lid: u32, n: u32, a_side: u32, a_at: u32, a_rs: u32, b_side: u32, b_at: u32, b_rs: u32, z: Sizes) {
    for (var e = lid; e < n * D8; e = e + 64u) {
        let c = e % D8;
        tile_a[e] = select(vec4<f32>(0.0), row4(a_side, a_at + (e / D8) * a_rs, min(c + 1u, D4) - 1u, z.d), c < D4);
    }
    for (var e = lid; e < n * DV8; e = e + 64u) {
        let c = e % DV8;
        tile_b[e] = select(vec4<f32>(0.0), row4(b_side, b_at + (e / DV8) * b_rs, min(c + 1u, DV4) - 1u, z.dv), c < DV4);
    }
}

// Keys [first, last) that some row of `block` attends to in its split: its first row starts
// earliest and its last row ends latest.
fn block_keys(block: HeadBlock) -> vec2<u32> {
    return vec2<u32>(key_range(block.first, block.split).x, key_range(block.last, block.split).y);
}

// Stages key rows t0 .. t0 + n into `tile_a` and their value rows into `tile_b`.
fn stage_keys_values(lid: u32, n: u32, t0: u32, kv: KeyValueRows, z: Sizes) {
    stage_tiles(lid, n, 1u, kv.k_head + t0 * kv.k_rs, kv.k_rs, 2u, kv.v_head + t0 * kv.v_rs, kv.v_rs, z);
}

// The dot product of a register row of q/k features with row `r` of `tile_a`.
fn dot_tile_a(row: ptr<function, array<vec4<f32>, D4>>, r: u32, z: Sizes) -> f32 {
    var sum = 0.0;
    for (var c = 0u; c < D4; c = c + 1u) {
        sum = sum + dot((*row)[c], tile_a[r * D8 + c]);
    }
    return sum;
}

// The q/k row of `side` at `at` times `scale`, and the v (or out grad) row of `side` at `at`,
// as register rows.
fn register_row_d(side: u32, at: u32, scale: f32, z: Sizes) -> array<vec4<f32>, D4> {
    var row: array<vec4<f32>, D4>;
    for (var c = 0u; c < D4; c = c + 1u) {
        row[c] = row4(side, at, c, z.d) * scale;
    }
    return row;
}

fn register_row_dv(side: u32, at: u32, z: Sizes) -> array<vec4<f32>, DV4> {
    var row: array<vec4<f32>, DV4>;
    for (var c = 0u; c < DV4; c = c + 1u) {
        row[c] = row4(side, at, c, z.dv);
    }
    return row;
}

// Adds `ds` times row `r` of `tile_a` to a register row of q/k features.
fn add_tile_a_row(row: ptr<function, array<vec4<f32>, D4>>, ds: f32, r: u32) {
    for (var c = 0u; c < D4; c = c + 1u) {
        (*row)[c] = (*row)[c] + ds * tile_a[r * D8 + c];
    }
}

@compute @workgroup_size(64)
fn forward_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let block = head_block(wid, nwg, t_q);
    if (!block.valid) {
        return;
    }
    let i = min(block.first + lid, t_q - 1u);
    let z = sizes();
    let kv = key_value_rows(block.h);
    var query = register_row_d(0u, row_start(block.h, i, ATTENTION_Q_LAYOUT), z.scale, z);
    var acc: array<vec4<f32>, DV4>;
    var m = neg_inf();
    var l = 0.0;
    let keys = key_range(i, block.split);
    let walked = block_keys(block);
    for (var t0 = walked.x; t0 < walked.y; t0 = t0 + TILE) {
        let n = min(TILE, walked.y - t0);
        stage_keys_values(lid, n, t0, kv, z);
        workgroupBarrier();
        for (var r = 0u; r < n; r = r + 1u) {
            let j = t0 + r;
            let score = masked_score(dot_tile_a(&query, r, z), block.h, i, j);
            let live = j >= keys.x && j < keys.y && score != neg_inf();
            let m_new = select(m, max(m, score), live);
            let correction = select(1.0, exp(m - m_new), live);
            let p = select(0.0, exp(score - m_new), live);
            l = l * correction + p;
            for (var c = 0u; c < DV4; c = c + 1u) {
                acc[c] = acc[c] * correction + p * tile_b[r * DV8 + c];
            }
            m = m_new;
        }
        workgroupBarrier();
    }
    if (block.first + lid >= t_q) {
        return;
    }
    let row = block.h * t_q + i;
    let out_base = forward_out_start(row, block.h, i, block.split);
    for (var c = 0u; c < DV4; c = c + 1u) {
        store_out(out_base + 4u * c, acc[c] * forward_out_scale(l), lanes(c, z.dv));
    }
    store_forward_stats(row, block.split, m, l);
}

// The query grad, as backward_query, for a workgroup owning 64 query rows of one head.
@compute @workgroup_size(64)
fn backward_query_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let block = head_block(wid, nwg, t_q);
    if (!block.valid) {
        return;
    }
    let h = block.h;
    let i = min(block.first + lid, t_q - 1u);
    let z = sizes();
    let kv = key_value_rows(h);
    var query = register_row_d(0u, row_start(h, i, ATTENTION_Q_LAYOUT), z.scale, z);
    let dout = register_row_dv(3u, row_start(h, i, ATTENTION_O_LAYOUT), z);
    var grad: array<vec4<f32>, D4>;
    let lse = stats[2u * (h * t_q + i)];
    let delta = stats[2u * (h * t_q + i) + 1u];
    let keys = key_range(i, block.split);
    let walked = block_keys(block);
    for (var t0 = walked.x; t0 < walked.y; t0 = t0 + TILE) {
        let n = min(TILE, walked.y - t0);
        stage_keys_values(lid, n, t0, kv, z);
        workgroupBarrier();
        for (var r = 0u; r < n; r = r + 1u) {
            let j = t0 + r;
            let score = masked_score(dot_tile_a(&query, r, z), h, i, j);
            let live = j >= keys.x && j < keys.y && score != neg_inf();
            var dp = 0.0;
            for (var c = 0u; c < DV4; c = c + 1u) {
                dp = dp + dot(dout[c], tile_b[r * DV8 + c]);
            }
            add_tile_a_row(&grad, select(0.0, exp(score - lse) * (dp - delta) * z.scale, live), r);
        }
        workgroupBarrier();
    }
    if (block.first + lid >= t_q) {
        return;
    }
    store_grad_a_row(&grad, row_start(h, i, ATTENTION_OUT_LAYOUT), z, block.split > 0u);
}

// The key and value grads, as backward_key, for a workgroup owning 64 key rows of one k/v
// head: the tiles hold query rows and their out grad rows, of each q head in turn.
@compute @workgroup_size(64)
fn backward_key_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let t_k = pu(ATTENTION_T_K);
    let block = head_block(wid, nwg, t_k);
    if (!block.valid) {
        return;
    }
    let h = block.h;
    let j = min(block.first + lid, t_k - 1u);
    let z = sizes();
    let q_rs = pu(ATTENTION_Q_LAYOUT + 4u);
    let o_rs = pu(ATTENTION_O_LAYOUT + 4u);
    let group = pu(ATTENTION_GROUP);
    var key = register_row_d(1u, row_start(h, j, ATTENTION_K_LAYOUT), z.scale, z);
    let value = register_row_dv(2u, row_start(h, j, ATTENTION_V_LAYOUT), z);
    var grad_key: array<vec4<f32>, D4>;
    var grad_value: array<vec4<f32>, DV4>;
    let queries = query_range(j, block.split);
    // The block's first key row is attended to by the most queries (causal: from itself on).
    let block_queries = query_range(block.first, block.split);
    for (var hq = h * group; hq < (h + 1u) * group; hq = hq + 1u) {
        let q_head = head_start(hq, ATTENTION_Q_LAYOUT);
        let o_head = head_start(hq, ATTENTION_O_LAYOUT);
        for (var t0 = block_queries.x; t0 < block_queries.y; t0 = t0 + TILE) {
            let n = min(TILE, block_queries.y - t0);
            stage_tiles(lid, n, 0u, q_head + t0 * q_rs, q_rs, 3u, o_head + t0 * o_rs, o_rs, z);
            workgroupBarrier();
            for (var r = 0u; r < n; r = r + 1u) {
                let i = t0 + r;
                let stat = 2u * (hq * t_q + i);
                let score = masked_score(dot_tile_a(&key, r, z), hq, i, j);
                let live = i >= queries.x && i < queries.y && score != neg_inf();
                let p = select(0.0, exp(score - stats[stat]), live);
                var dp = 0.0;
                for (var c = 0u; c < DV4; c = c + 1u) {
                    let g = tile_b[r * DV8 + c];
                    dp = dp + dot(g, value[c]);
                    grad_value[c] = grad_value[c] + p * g;
                }
                add_tile_a_row(&grad_key, p * (dp - stats[stat + 1u]) * z.scale, r);
            }
            workgroupBarrier();
        }
    }
    if (block.first + lid >= t_k) {
        return;
    }
    store_grad_a_row(&grad_key, row_start(h, j, ATTENTION_OUT_LAYOUT), z, block.split > 0u);
    for (var c = 0u; c < DV4; c = c + 1u) {
        add_grad_b(row_start(h, j, ATTENTION_OUT2_LAYOUT) + 4u * c, grad_value[c], lanes(c, z.dv), block.split > 0u);
    }
}

// SUBGROUP SECTION BEGIN: kept where the device has subgroups of 8 or more lanes (the
// `*_shared` entries run only where they are 8 wide).
//
// The `*_shared` entries do what the entries above do, for a subgroup of 8 invocations that
// own 8 consecutive rows of one head (each head's rows padded to whole 8s, see
// owned_in_head). All 8 then read the same rows of the other side, so each row is loaded once per
// subgroup: lane l loads feature group g + l of it and subgroupBroadcast hands every lane all
// 8 groups. A software adapter runs each load as a loop over the lanes, so this is 8x fewer
// loads. The subgroup loops over the union of its rows' ranges (the lanes stay together for
// the broadcasts), and each row skips what lies outside its own. Row arrays are padded to
// whole 8s of feature groups (zero past the row), so a group's 8 terms need no bounds.

// Group `c` of a row kept in registers (`D8` or `DV8` groups), picked with selects: indexing
// the array with `c` would move it to memory, and a loop over the groups with a constant bound
// would compile its stores once per group.
fn group_of_d(row: ptr<function, array<vec4<f32>, D8>>, c: u32) -> vec4<f32> {
    var value = (*row)[0];
    for (var e = 1u; e < D8; e = e + 1u) {
        value = select(value, (*row)[e], c == e);
    }
    return value;
}

fn group_of_dv(row: ptr<function, array<vec4<f32>, DV8>>, c: u32) -> vec4<f32> {
    var value = (*row)[0];
    for (var e = 1u; e < DV8; e = e + 1u) {
        value = select(value, (*row)[e], c == e);
    }
    return value;
}

// The 8 feature groups g .. g + 8 of a row, from one vec4 per lane (lane l loaded g + l).
fn groups8(mine: vec4<f32>) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(subgroupBroadcast(mine, 0u), subgroupBroadcast(mine, 1u),
                               subgroupBroadcast(mine, 2u), subgroupBroadcast(mine, 3u),
                               subgroupBroadcast(mine, 4u), subgroupBroadcast(mine, 5u),
                               subgroupBroadcast(mine, 6u), subgroupBroadcast(mine, 7u));
}

// The feature group a lane loads for groups g .. g + 8 of a row of `n4` groups (the last one
// again past the row's end; those lanes' groups meet only zero padding).
fn lane_group(g: u32, lane: u32, n4: u32) -> u32 {
    return min(g + lane, n4 - 1u);
}

// Group `c` of the row of `side` at `at` (of `n4` groups), zero from the row's last group on:
// the register rows of the `*_shared` entries are padded to whole 8s of groups.
fn padded_group(side: u32, at: u32, c: u32, n4: u32, len: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), row4(side, at, min(c, n4 - 1u), len), c < n4);
}

// A register row: the row of `side` at `at` as `D8` (`DV8`) groups times `scale`, zero from
// group `n4` on. The groups are read in a rolled loop, one storage access site where a loop
// of constant bound compiles one per group (each site costs lavapipe 25 compile time: 16 of
// them took the `*_shared` backward kernels to 0.7-0.9 s), and each lands with selects at
// constant indices: indexing the array with the loop's counter would move it to memory.
fn padded_row_d(side: u32, at: u32, n4: u32, len: u32, scale: f32) -> array<vec4<f32>, D8> {
    var row: array<vec4<f32>, D8>;
    for (var c = 0u; c < rolled(D8); c = c + 1u) {
        let group = padded_group(side, at, c, n4, len) * scale;
        for (var e = 0u; e < D8; e = e + 1u) {
            row[e] = select(row[e], group, c == e);
        }
    }
    return row;
}

fn padded_row_dv(side: u32, at: u32, n4: u32, len: u32) -> array<vec4<f32>, DV8> {
    var row: array<vec4<f32>, DV8>;
    for (var c = 0u; c < rolled(DV8); c = c + 1u) {
        let group = padded_group(side, at, c, n4, len);
        for (var e = 0u; e < DV8; e = e + 1u) {
            row[e] = select(row[e], group, c == e);
        }
    }
    return row;
}

// The dot product of a register row (`D8` groups of q/k features) with the row of `side` at
// `at`, which the subgroup's lanes load a group each and broadcast.
fn dot_shared(row: ptr<function, array<vec4<f32>, D8>>, side: u32, at: u32, lane: u32, z: Sizes) -> f32 {
    var sum = 0.0;
    for (var g = 0u; g < D8; g = g + 8u) {
        let other = groups8(row4(side, at, lane_group(g, lane, z.d4), z.d));
        for (var e = 0u; e < 8u; e = e + 1u) {
            sum = sum + dot((*row)[g + e], other[e]);
        }
    }
    return sum;
}

// Adds `ds` times the row of `side` at `at` (loaded and broadcast as in `dot_shared`) to a
// register row of q/k features.
fn add_scaled_shared(row: ptr<function, array<vec4<f32>, D8>>, ds: f32, side: u32, at: u32, lane: u32, z: Sizes) {
    for (var g = 0u; g < D8; g = g + 8u) {
        let other = groups8(row4(side, at, lane_group(g, lane, z.d4), z.d));
        for (var e = 0u; e < 8u; e = e + 1u) {
            (*row)[g + e] = (*row)[g + e] + ds * other[e];
        }
    }
}

// The row a `*_shared` invocation owns, where each head's `t` rows are padded to whole 8s so
// that a subgroup owns 8 rows of one head: `i`, the row in head `h`, is clamped to the last
// real row for the padding's lanes (`ghost`), which load and broadcast with their subgroup but
// store nothing. `first` and `last` are the subgroup's first and last real rows.
struct OwnedInHead {
    h: u32,
    i: u32,
    first: u32,
    last: u32,
    split: u32,
    valid: bool,
    ghost: bool,
}

fn owned_in_head(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, t: u32) -> OwnedInHead {
    let padded = (t + 7u) / 8u * 8u;
    let per_split = (pu(ATTENTION_ROWS) / t) * padded;
    let g = workgroup_index(wid, nwg) * 64u + lid;
    let p = g % per_split;
    let i = p % padded;
    let first = i - i % 8u;
    let valid = g < per_split * pu(ATTENTION_SPLITS);
    let ghost = i >= t;
    let split = g / per_split + pu(ATTENTION_SPLIT);
    return OwnedInHead(p / padded, min(i, t - 1u), first, min(first + 7u, t - 1u), split, valid, ghost);
}

@compute @workgroup_size(64)
fn forward_shared(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let row = owned_in_head(wid, nwg, lid, pu(ATTENTION_T_Q));
    // Heads are padded to whole 8s of rows, so whole subgroups leave here.
    if (!row.valid) {
        return;
    }
    let kv = key_value_rows(row.h);
    let z = sizes();
    var query = padded_row_d(0u, row_start(row.h, row.i, ATTENTION_Q_LAYOUT), z.d4, z.d, z.scale);
    var acc: array<vec4<f32>, DV8>;
    var m = neg_inf();
    var l = 0.0;
    let keys = key_range(row.i, row.split);
    // The subgroup's first row starts earliest and its last ends latest.
    let shared_keys = vec2<u32>(key_range(row.first, row.split).x, key_range(row.last, row.split).y);
    for (var j = shared_keys.x; j < shared_keys.y; j = j + 1u) {
        let score = masked_score(dot_shared(&query, 1u, kv.k_head + j * kv.k_rs, lane, z), row.h, row.i, j);
        let live = j >= keys.x && j < keys.y && score != neg_inf();
        let m_new = select(m, max(m, score), live);
        let correction = select(1.0, exp(m - m_new), live);
        let p = select(0.0, exp(score - m_new), live);
        l = l * correction + p;
        for (var g = 0u; g < DV8; g = g + 8u) {
            let vg = groups8(v4(kv.v_head + j * kv.v_rs, lane_group(g, lane, z.dv4), z.dv));
            for (var e = 0u; e < 8u; e = e + 1u) {
                acc[g + e] = acc[g + e] * correction + p * vg[e];
            }
        }
        m = m_new;
    }
    if (row.ghost) {
        return;
    }
    let at = row.h * pu(ATTENTION_T_Q) + row.i;
    let out_base = forward_out_start(at, row.h, row.i, row.split);
    for (var c = 0u; c < z.dv4; c = c + 1u) {
        store_out(out_base + 4u * c, group_of_dv(&acc, c) * forward_out_scale(l), lanes(c, z.dv));
    }
    store_forward_stats(at, row.split, m, l);
}

// The query grad, as backward_query, for a subgroup owning 8 query rows of one head.
@compute @workgroup_size(64)
fn backward_query_shared(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let query_row = owned_in_head(wid, nwg, lid, t_q);
    let z = sizes();
    if (!query_row.valid) {
        return;
    }
    let kv = key_value_rows(query_row.h);
    var query = padded_row_d(0u, row_start(query_row.h, query_row.i, ATTENTION_Q_LAYOUT), z.d4, z.d, z.scale);
    var grad: array<vec4<f32>, D8>;
    var dout = padded_row_dv(3u, row_start(query_row.h, query_row.i, ATTENTION_O_LAYOUT), z.dv4, z.dv);
    let lse = stats[2u * (query_row.h * t_q + query_row.i)];
    let delta = stats[2u * (query_row.h * t_q + query_row.i) + 1u];
    let keys = key_range(query_row.i, query_row.split);
    let shared_keys = vec2<u32>(key_range(query_row.first, query_row.split).x, key_range(query_row.last, query_row.split).y);
    for (var j = shared_keys.x; j < shared_keys.y; j = j + 1u) {
        let k_row = kv.k_head + j * kv.k_rs;
        let score = masked_score(dot_shared(&query, 1u, k_row, lane, z), query_row.h, query_row.i, j);
        var dp = 0.0;
        for (var g = 0u; g < DV8; g = g + 8u) {
            let vg = groups8(v4(kv.v_head + j * kv.v_rs, lane_group(g, lane, z.dv4), z.dv));
            for (var e = 0u; e < 8u; e = e + 1u) {
                dp = dp + dot(dout[g + e], vg[e]);
            }
        }
        let live = j >= keys.x && j < keys.y && score != neg_inf();
        let ds = select(0.0, exp(score - lse) * (dp - delta) * z.scale, live);
        // Key row j again: one load and 8 broadcasts per lane, which measured no slower than
        // keeping the row from the score loop (a fourth register array).
        add_scaled_shared(&grad, ds, 1u, k_row, lane, z);
    }
    if (query_row.ghost) {
        return;
    }
    for (var c = 0u; c < z.d4; c = c + 1u) {
        add_grad_a(row_start(query_row.h, query_row.i, ATTENTION_OUT_LAYOUT) + 4u * c, group_of_d(&grad, c), lanes(c, z.d), query_row.split > 0u);
    }
}

// The key and value grads, as backward_key, for a subgroup owning 8 key rows of one head.
@compute @workgroup_size(64)
fn backward_key_shared(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let key_row = owned_in_head(wid, nwg, lid, pu(ATTENTION_T_K));
    if (!key_row.valid) {
        return;
    }
    let z = sizes();
    let q_rs = pu(ATTENTION_Q_LAYOUT + 4u);
    let o_rs = pu(ATTENTION_O_LAYOUT + 4u);
    let group = pu(ATTENTION_GROUP);
    var key = padded_row_d(1u, row_start(key_row.h, key_row.i, ATTENTION_K_LAYOUT), z.d4, z.d, z.scale);
    var grad_key: array<vec4<f32>, D8>;
    var value = padded_row_dv(2u, row_start(key_row.h, key_row.i, ATTENTION_V_LAYOUT), z.dv4, z.dv);
    var grad_value: array<vec4<f32>, DV8>;
    let queries = query_range(key_row.i, key_row.split);
    // The subgroup's first key row is attended to by the most queries (causal: from itself on).
    let shared_queries = query_range(key_row.first, key_row.split);
    for (var hq = key_row.h * group; hq < (key_row.h + 1u) * group; hq = hq + 1u) {
        let q_head = head_start(hq, ATTENTION_Q_LAYOUT);
        let o_head = head_start(hq, ATTENTION_O_LAYOUT);
        for (var i = shared_queries.x; i < shared_queries.y; i = i + 1u) {
            let q_row = q_head + i * q_rs;
            let stat = 2u * (hq * t_q + i);
            let score = masked_score(dot_shared(&key, 0u, q_row, lane, z), hq, i, key_row.i);
            let live = i >= queries.x && i < queries.y && score != neg_inf();
            let p = select(0.0, exp(score - stats[stat]), live);
            var dp = 0.0;
            for (var g = 0u; g < DV8; g = g + 8u) {
                let og = groups8(dout4(o_head + i * o_rs, lane_group(g, lane, z.dv4), z.dv));
                for (var e = 0u; e < 8u; e = e + 1u) {
                    dp = dp + dot(og[e], value[g + e]);
                    grad_value[g + e] = grad_value[g + e] + p * og[e];
                }
            }
            // Query row i again, as backward_query_shared reloads its key row.
            add_scaled_shared(&grad_key, p * (dp - stats[stat + 1u]) * z.scale, 0u, q_row, lane, z);
        }
    }
    if (key_row.ghost) {
        return;
    }
    for (var c = 0u; c < z.d4; c = c + 1u) {
        add_grad_a(row_start(key_row.h, key_row.i, ATTENTION_OUT_LAYOUT) + 4u * c, group_of_d(&grad_key, c), lanes(c, z.d), key_row.split > 0u);
    }
    for (var c = 0u; c < z.dv4; c = c + 1u) {
        add_grad_b(row_start(key_row.h, key_row.i, ATTENTION_OUT2_LAYOUT) + 4u * c, group_of_dv(&grad_value, c), lanes(c, z.dv), key_row.split > 0u);
    }
}

// SUBGROUP SECTION END

// SUBGROUP SECTION BEGIN: kept where the device has subgroups of 8 or more lanes.
//
// LANE TILES: the `*_tiled_lanes` entries stage tiles as the `*_tiled` ones do, for a
// workgroup owning 64 rows of one head, but split the work between lanes as a register-blocked
// GEMM does: each 8 consecutive invocations (a lane group, inside one subgroup) own 8 rows,
// and lane `k` of the group keeps feature groups k, k + 8, k + 16, .. of all 8 rows. For each
// row of the other side a lane then reads only its groups of the tile row (8 lanes, 8
// adjacent vec4s: no bank conflicts on a GPU, a vector load on a CPU adapter rather than a
// broadcast per feature) and uses each for all 8 of its rows. The 8 partial dot products meet
// in 7 shuffles (`sum_rows8`), after which lane `k` holds row `k`'s score, keeps that row's
// softmax state and hands the weights back to the group in 7 more (`gather8`). The shuffles
// use lane masks 1, 2 and 4, so they stay inside a lane group whatever the subgroup's width
// (a subgroup is a run of consecutive invocations on every driver known).

// Feature groups per lane: of a q/k row and of a v row.
const LANE_D: u32 = D8 / 8u;
const LANE_DV: u32 = DV8 / 8u;

// The sums over the group's 8 lanes of `parts[r]`, each a pair: lane `k` gets row `k`'s.
// Each step halves the rows a lane holds: it keeps the half its lane bit picks and adds its
// partner's share of that half.
fn sum_rows8(parts: array<vec2<f32>, 8>, lane: u32) -> vec2<f32> {
    let high4 = (lane & 4u) != 0u;
    var four: array<vec2<f32>, 4>;
    for (var r = 0u; r < 4u; r = r + 1u) {
        let keep = select(parts[r], parts[r + 4u], high4);
        let give = select(parts[r + 4u], parts[r], high4);
        four[r] = keep + subgroupShuffleXor(give, 4u);
    }
    let high2 = (lane & 2u) != 0u;
    var two: array<vec2<f32>, 2>;
    for (var r = 0u; r < 2u; r = r + 1u) {
        let keep = select(four[r], four[r + 2u], high2);
        let give = select(four[r + 2u], four[r], high2);
        two[r] = keep + subgroupShuffleXor(give, 2u);
    }
    let high1 = (lane & 1u) != 0u;
    return select(two[0], two[1], high1) + subgroupShuffleXor(select(two[1], two[0], high1), 1u);
}

// Every lane's `mine` to every lane of the group: entry `r` is lane `r`'s. Each step swaps
// what a lane has gathered with its partner's, doubling it.
fn gather8(mine: vec2<f32>, lane: u32) -> array<vec2<f32>, 8> {
    let other1 = subgroupShuffleXor(mine, 1u);
    let high1 = (lane & 1u) != 0u;
    var two = array<vec2<f32>, 2>(select(mine, other1, high1), select(other1, mine, high1));
    let high2 = (lane & 2u) != 0u;
    var four: array<vec2<f32>, 4>;
    for (var r = 0u; r < 2u; r = r + 1u) {
        let other = subgroupShuffleXor(two[r], 2u);
        four[r] = select(two[r], other, high2);
        four[r + 2u] = select(other, two[r], high2);
    }
    let high4 = (lane & 4u) != 0u;
    var eight: array<vec2<f32>, 8>;
    for (var r = 0u; r < 4u; r = r + 1u) {
        let other = subgroupShuffleXor(four[r], 4u);
        eight[r] = select(four[r], other, high4);
        eight[r + 4u] = select(other, four[r], high4);
    }
    return eight;
}

// The lane's groups of the 8 rows of `side` whose head starts at `head`, rows `first` .. `first
// + 8`, `rs` apart (clamped to `last`): `LANE_D` groups a row (q/k, times `scale`) or
// `LANE_DV` (v, out grad), row-major.
fn lane_rows_d(side: u32, head: u32, rs: u32, first: u32, last: u32, lane: u32, scale: f32, z: Sizes) -> array<vec4<f32>, 8 * LANE_D> {
    var rows: array<vec4<f32>, 8 * LANE_D>;
    for (var r = 0u; r < 8u; r = r + 1u) {
        for (var c = 0u; c < LANE_D; c = c + 1u) {
            rows[r * LANE_D + c] = padded_group(side, head + min(first + r, last) * rs, c * 8u + lane, z.d4, z.d) * scale;
        }
    }
    return rows;
}

fn lane_rows_dv(side: u32, head: u32, rs: u32, first: u32, last: u32, lane: u32, z: Sizes) -> array<vec4<f32>, 8 * LANE_DV> {
    var rows: array<vec4<f32>, 8 * LANE_DV>;
    for (var r = 0u; r < 8u; r = r + 1u) {
        for (var c = 0u; c < LANE_DV; c = c + 1u) {
            rows[r * LANE_DV + c] = padded_group(side, head + min(first + r, last) * rs, c * 8u + lane, z.dv4, z.dv);
        }
    }
    return rows;
}

// The lane's groups of row `r` of `tile_a` (`tile_b`).
fn lane_tile_a(r: u32, lane: u32) -> array<vec4<f32>, LANE_D> {
    var groups: array<vec4<f32>, LANE_D>;
    for (var c = 0u; c < LANE_D; c = c + 1u) {
        groups[c] = tile_a[r * D8 + c * 8u + lane];
    }
    return groups;
}

fn lane_tile_b(r: u32, lane: u32) -> array<vec4<f32>, LANE_DV> {
    var groups: array<vec4<f32>, LANE_DV>;
    for (var c = 0u; c < LANE_DV; c = c + 1u) {
        groups[c] = tile_b[r * DV8 + c * 8u + lane];
    }
    return groups;
}

// The lane's share of the dot products of each of its 8 register rows with one row's groups.
fn lane_dots_d(rows: ptr<function, array<vec4<f32>, 8 * LANE_D>>, other: ptr<function, array<vec4<f32>, LANE_D>>) -> array<f32, 8> {
    var dots: array<f32, 8>;
    for (var r = 0u; r < 8u; r = r + 1u) {
        var sum = 0.0;
        for (var c = 0u; c < LANE_D; c = c + 1u) {
            sum = sum + dot((*rows)[r * LANE_D + c], (*other)[c]);
        }
        dots[r] = sum;
    }
    return dots;
}

fn lane_dots_dv(rows: ptr<function, array<vec4<f32>, 8 * LANE_DV>>, other: ptr<function, array<vec4<f32>, LANE_DV>>) -> array<f32, 8> {
    var dots: array<f32, 8>;
    for (var r = 0u; r < 8u; r = r + 1u) {
        var sum = 0.0;
        for (var c = 0u; c < LANE_DV; c = c + 1u) {
            sum = sum + dot((*rows)[r * LANE_DV + c], (*other)[c]);
        }
        dots[r] = sum;
    }
    return dots;
}

// Adds `weights[r]` (a pair's `.x`, or `.y` when `second`) times one row's groups to each
// register row `r`.
fn add_weighted_d(rows: ptr<function, array<vec4<f32>, 8 * LANE_D>>, weights: ptr<function, array<vec2<f32>, 8>>, second: bool, other: ptr<function, array<vec4<f32>, LANE_D>>) {
    for (var r = 0u; r < 8u; r = r + 1u) {
        let w = select((*weights)[r].x, (*weights)[r].y, second);
        for (var c = 0u; c < LANE_D; c = c + 1u) {
            (*rows)[r * LANE_D + c] = (*rows)[r * LANE_D + c] + w * (*other)[c];
        }
    }
}

fn add_weighted_dv(rows: ptr<function, array<vec4<f32>, 8 * LANE_DV>>, weights: ptr<function, array<vec2<f32>, 8>>, second: bool, other: ptr<function, array<vec4<f32>, LANE_DV>>) {
    for (var r = 0u; r < 8u; r = r + 1u) {
        let w = select((*weights)[r].x, (*weights)[r].y, second);
        for (var c = 0u; c < LANE_DV; c = c + 1u) {
            (*rows)[r * LANE_DV + c] = (*rows)[r * LANE_DV + c] + w * (*other)[c];
        }
    }
}

// The two dot products of each register-row pair, summed over the lane group: lane `k` gets
// row `k`'s pair.
fn pair_dots(a: array<f32, 8>, b: array<f32, 8>, lane: u32) -> vec2<f32> {
    var parts: array<vec2<f32>, 8>;
    for (var r = 0u; r < 8u; r = r + 1u) {
        parts[r] = vec2<f32>(a[r], b[r]);
    }
    return sum_rows8(parts, lane);
}

@compute @workgroup_size(64)
fn forward_tiled_lanes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let block = head_block(wid, nwg, t_q);
    if (!block.valid) {
        return;
    }
    let lane = lid % 8u;
    let first = block.first + lid - lane; // the lane group's first row
    let i = min(block.first + lid, t_q - 1u); // the row whose softmax state this lane keeps
    let z = sizes();
    let kv = key_value_rows(block.h);
    let q_head = head_start(block.h, ATTENTION_Q_LAYOUT);
    var query = lane_rows_d(0u, q_head, pu(ATTENTION_Q_LAYOUT + 4u), first, t_q - 1u, lane, z.scale, z);
    var acc: array<vec4<f32>, 8 * LANE_DV>;
    var m = neg_inf();
    var l = 0.0;
    let keys = key_range(i, block.split);
    let walked = block_keys(block);
    for (var t0 = walked.x; t0 < walked.y; t0 = t0 + TILE) {
        let n = min(TILE, walked.y - t0);
        stage_keys_values(lid, n, t0, kv, z);
        workgroupBarrier();
        for (var r = 0u; r < n; r = r + 1u) {
            let j = t0 + r;
            var key = lane_tile_a(r, lane);
            let dots = lane_dots_d(&query, &key);
            let score = masked_score(pair_dots(dots, dots, lane).x, block.h, i, j);
            let live = j >= keys.x && j < keys.y && score != neg_inf();
            let m_new = select(m, max(m, score), live);
            let correction = select(1.0, exp(m - m_new), live);
            let p = select(0.0, exp(score - m_new), live);
            l = l * correction + p;
            m = m_new;
            // Each row's (weight, correction), from the lane that keeps it.
            var weights = gather8(vec2<f32>(p, correction), lane);
            var value = lane_tile_b(r, lane);
            for (var row = 0u; row < 8u; row = row + 1u) {
                for (var c = 0u; c < LANE_DV; c = c + 1u) {
                    acc[row * LANE_DV + c] = acc[row * LANE_DV + c] * weights[row].y;
                }
            }
            add_weighted_dv(&acc, &weights, false, &value);
        }
        workgroupBarrier();
    }
    // Each row's scale, from the lane that keeps it.
    let scales = gather8(vec2<f32>(forward_out_scale(l)), lane);
    for (var row = 0u; row < 8u; row = row + 1u) {
        let ir = first + row;
        if (ir < t_q) {
            let out_base = forward_out_start(block.h * t_q + ir, block.h, ir, block.split);
            for (var c = 0u; c < LANE_DV; c = c + 1u) {
                let g = c * 8u + lane;
                if (g < z.dv4) {
                    store_out(out_base + 4u * g, acc[row * LANE_DV + c] * scales[row].x, lanes(g, z.dv));
                }
            }
        }
    }
    if (block.first + lid < t_q) {
        store_forward_stats(block.h * t_q + i, block.split, m, l);
    }
}

// Writes the lane's groups of 8 register rows of q/k features to grad_a, row `r` of head `h`
// at `first + r` (rows past `last` skipped), added to what is there when `add`.
fn store_lane_rows_a(rows: ptr<function, array<vec4<f32>, 8 * LANE_D>>, h: u32, first: u32, last: u32, lane: u32, z: Sizes, add: bool) {
    for (var r = 0u; r < 8u; r = r + 1u) {
        if (first + r <= last) {
            let at = row_start(h, first + r, ATTENTION_OUT_LAYOUT);
            for (var c = 0u; c < LANE_D; c = c + 1u) {
                let g = c * 8u + lane;
                if (g < z.d4) {
                    add_grad_a(at + 4u * g, (*rows)[r * LANE_D + c], lanes(g, z.d), add);
                }
            }
        }
    }
}

// The query grad, as backward_query_tiled, with lane groups of 8 query rows.
@compute @workgroup_size(64)
fn backward_query_tiled_lanes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let block = head_block(wid, nwg, t_q);
    if (!block.valid) {
        return;
    }
    let h = block.h;
    let lane = lid % 8u;
    let first = block.first + lid - lane;
    let i = min(block.first + lid, t_q - 1u);
    let z = sizes();
    let kv = key_value_rows(h);
    var query = lane_rows_d(0u, head_start(h, ATTENTION_Q_LAYOUT), pu(ATTENTION_Q_LAYOUT + 4u), first, t_q - 1u, lane, z.scale, z);
    var dout = lane_rows_dv(3u, head_start(h, ATTENTION_O_LAYOUT), pu(ATTENTION_O_LAYOUT + 4u), first, t_q - 1u, lane, z);
    var grad: array<vec4<f32>, 8 * LANE_D>;
    let lse = stats[2u * (h * t_q + i)];
    let delta = stats[2u * (h * t_q + i) + 1u];
    let keys = key_range(i, block.split);
    let walked = block_keys(block);
    for (var t0 = walked.x; t0 < walked.y; t0 = t0 + TILE) {
        let n = min(TILE, walked.y - t0);
        stage_keys_values(lid, n, t0, kv, z);
        workgroupBarrier();
        for (var r = 0u; r < n; r = r + 1u) {
            let j = t0 + r;
            var key = lane_tile_a(r, lane);
            var value = lane_tile_b(r, lane);
            // (score, dp) of the lane's row.
            let sums = pair_dots(lane_dots_d(&query, &key), lane_dots_dv(&dout, &value), lane);
            let score = masked_score(sums.x, h, i, j);
            let live = j >= keys.x && j < keys.y && score != neg_inf();
            var ds = gather8(vec2<f32>(select(0.0, exp(score - lse) * (sums.y - delta) * z.scale, live)), lane);
            add_weighted_d(&grad, &ds, false, &key);
        }
        workgroupBarrier();
    }
    store_lane_rows_a(&grad, h, first, t_q - 1u, lane, z, block.split > 0u);
}

// The key and value grads, as backward_key_tiled, with lane groups of 8 key rows.
@compute @workgroup_size(64)
fn backward_key_tiled_lanes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) lid: u32) {
    let t_q = pu(ATTENTION_T_Q);
    let t_k = pu(ATTENTION_T_K);
    let block = head_block(wid, nwg, t_k);
    if (!block.valid) {
        return;
    }
    let h = block.h;
    let lane = lid % 8u;
    let first = block.first + lid - lane;
    let j = min(block.first + lid, t_k - 1u);
    let z = sizes();
    let q_rs = pu(ATTENTION_Q_LAYOUT + 4u);
    let o_rs = pu(ATTENTION_O_LAYOUT + 4u);
    let group = pu(ATTENTION_GROUP);
    var key = lane_rows_d(1u, head_start(h, ATTENTION_K_LAYOUT), pu(ATTENTION_K_LAYOUT + 4u), first, t_k - 1u, lane, z.scale, z);
    var value = lane_rows_dv(2u, head_start(h, ATTENTION_V_LAYOUT), pu(ATTENTION_V_LAYOUT + 4u), first, t_k - 1u, lane, z);
    var grad_key: array<vec4<f32>, 8 * LANE_D>;
    var grad_value: array<vec4<f32>, 8 * LANE_DV>;
    let queries = query_range(j, block.split);
    let block_queries = query_range(block.first, block.split);
    for (var hq = h * group; hq < (h + 1u) * group; hq = hq + 1u) {
        let q_head = head_start(hq, ATTENTION_Q_LAYOUT);
        let o_head = head_start(hq, ATTENTION_O_LAYOUT);
        for (var t0 = block_queries.x; t0 < block_queries.y; t0 = t0 + TILE) {
            let n = min(TILE, block_queries.y - t0);
            stage_tiles(lid, n, 0u, q_head + t0 * q_rs, q_rs, 3u, o_head + t0 * o_rs, o_rs, z);
            workgroupBarrier();
            for (var r = 0u; r < n; r = r + 1u) {
                let i = t0 + r;
                let stat = 2u * (hq * t_q + i);
                var query = lane_tile_a(r, lane);
                var dout = lane_tile_b(r, lane);
                // (score, dp) of the lane's key row.
                let sums = pair_dots(lane_dots_d(&key, &query), lane_dots_dv(&value, &dout), lane);
                let score = masked_score(sums.x, hq, i, j);
                let live = i >= queries.x && i < queries.y && score != neg_inf();
                let p = select(0.0, exp(score - stats[stat]), live);
                // Each row's (p, ds), from the lane that keeps it.
                var weights = gather8(vec2<f32>(p, p * (sums.y - stats[stat + 1u]) * z.scale), lane);
                add_weighted_dv(&grad_value, &weights, false, &dout);
                add_weighted_d(&grad_key, &weights, true, &query);
            }
            workgroupBarrier();
        }
    }
    store_lane_rows_a(&grad_key, h, first, t_k - 1u, lane, z, block.split > 0u);
    for (var r = 0u; r < 8u; r = r + 1u) {
        if (first + r < t_k) {
            let at = row_start(h, first + r, ATTENTION_OUT2_LAYOUT);
            for (var c = 0u; c < LANE_DV; c = c + 1u) {
                let g = c * 8u + lane;
                if (g < z.dv4) {
                    add_grad_b(at + 4u * g, grad_value[r * LANE_DV + c], lanes(g, z.dv), block.split > 0u);
                }
            }
        }
    }
}

// SUBGROUP SECTION END
