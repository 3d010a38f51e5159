// Row-wise softmax, log-softmax and the fused cross-entropy (log-softmax + NLL) of a
// contiguous [M, K] tensor. The row max is subtracted first, so large logits stay finite.
// Two ways to run a row: `*_rows` entries give each row a group of lanes (GPUs): a workgroup
// of 64 that reduces in workgroup memory, or, in the module specialised for short rows on a
// device with subgroups, a subgroup (see row_group); `*_serial` entries give each row one
// invocation and no barriers (software adapters, where barriers are coroutine switches),
// reading four elements at a time when K and the offset are multiples of 4.
// The backward entries are fused the same way: softmax_backward takes the forward's output y
// and the incoming grad g; cross_entropy_backward recomputes the row's softmax from the logits.
// The cross-entropy entries take torch's options (class weights, ignore_index,
// label_smoothing) and write one loss per row, which the host reduces.
// Params: `SoftmaxParams` (src/ops/softmax.rs).

@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> labels: array<u32>;
@group(0) @binding(4) var<storage, read> grad: array<vec4<f32>>;
// cross_entropy: the class weights (any buffer when unweighted).
@group(0) @binding(5) var<storage, read> class_weight: array<f32>;

const WG: u32 = 64u;
const NEG_INF: f32 = -3.40282347e38;

fn src_at(i: u32) -> f32 {
    return src[i / 4u][i % 4u];
}

fn grad_at(i: u32) -> f32 {
    let at = pu(SOFTMAX_GRAD_OFFSET) + i;
    return grad[at / 4u][at % 4u];
}

fn set_dst(i: u32, v: f32) {
    let at = pu(SOFTMAX_DST_OFFSET) + i;
    dst[at / 4u][at % 4u] = v;
}

// The value softmax (or log_softmax) writes for x, given the row's max and log-sum-exp.
fn softmax_value(x: f32, stats: vec2<f32>) -> f32 {
    let shifted = x - stats.x - stats.y;
    if (pu(SOFTMAX_LOG) == 1u) {
        return shifted;
    }
    return exp(shifted);
}

// The lanes that run one row of a `*_rows` entry (row_group.wgsl): ROW_GROUP is spliced with
// workgroup_row (a workgroup of WG per row) or subgroup_row (a subgroup per row), and
// ROW_REDUCE with the matching sum or max over the lanes: row_reduce_subgroups or
// row_reduce_tree for a workgroup (workgroup_reduce.wgsl), row_reduce_in_subgroup for a
// subgroup.
fn row_group(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> RowGroup {
    return ROW_GROUP(wid, nwg, lid, WG, pu(SOFTMAX_ROWS));
}

fn row_reduce(g: RowGroup, v: f32, is_max: bool) -> f32 {
    return ROW_REDUCE(g.lane, v, is_max);
}

fn row_reduce_tree(lid: u32, v: f32, is_max: bool) -> f32 {
    return workgroup_reduce_tree(lid, v, is_max, WG);
}

// SUBGROUP SECTION BEGIN: kept only where the device has subgroups of a fixed width.
fn row_reduce_subgroups(lid: u32, v: f32, is_max: bool) -> f32 {
    return workgroup_reduce_subgroups(lid, v, is_max, WG);
}

// The sum (or the max) of `v` over the subgroup: no barrier.
fn row_reduce_in_subgroup(lane: u32, v: f32, is_max: bool) -> f32 {
    return select(subgroupAdd(v), subgroupMax(v), is_max);
}
// SUBGROUP SECTION END

// The row's max and log(sum(exp(x - max))), computed by the row's lanes.
fn row_stats_group(base: u32, k_len: u32, g: RowGroup) -> vec2<f32> {
    var m = NEG_INF;
    for (var k = g.lane; k < k_len; k = k + g.lanes) {
        m = max(m, src_at(base + k));
    }
    m = row_reduce(g, m, true);
    var s = 0.0;
    for (var k = g.lane; k < k_len; k = k + g.lanes) {
        s = s + exp(src_at(base + k) - m);
    }
    return vec2<f32>(m, log(row_reduce(g, s, false)));
}

// The same, by one invocation.
fn row_stats_serial(base: u32, k_len: u32) -> vec2<f32> {
    var m = NEG_INF;
    var s = 0.0;
    if (pu(SOFTMAX_VEC4) == 1u) {
        var m4 = vec4<f32>(NEG_INF);
        for (var k = 0u; k < k_len; k = k + 4u) {
            m4 = max(m4, src[(base + k) / 4u]);
        }
        m = max(max(m4.x, m4.y), max(m4.z, m4.w));
        var s4 = vec4<f32>(0.0);
        for (var k = 0u; k < k_len; k = k + 4u) {
            s4 = s4 + exp(src[(base + k) / 4u] - m);
        }
        s = s4.x + s4.y + s4.z + s4.w;
    } else {
        for (var k = 0u; k < k_len; k = k + 1u) {
            m = max(m, src_at(base + k));
        }
        for (var k = 0u; k < k_len; k = k + 1u) {
            s = s + exp(src_at(base + k) - m);
        }
    }
    return vec2<f32>(m, log(s));
}

@compute @workgroup_size(64)
fn softmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    for (var g = row_group(wid, nwg, lid); g.row < g.end; g.row = g.row + g.step) {
        softmax_row(g);
    }
}

// One row of `softmax_rows`.
fn softmax_row(g: RowGroup) {
    let row = g.row;
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_group(base, k_len, g);
    for (var k = g.lane; k < k_len; k = k + g.lanes) {
        set_dst(row * k_len + k, softmax_value(src_at(base + k), stats));
    }
}

@compute @workgroup_size(64)
fn softmax_serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * WG + lid;
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_serial(base, k_len);
    if (pu(SOFTMAX_VEC4) == 1u) {
        for (var k = 0u; k < k_len; k = k + 4u) {
            let x = src[(base + k) / 4u];
            let v = vec4<f32>(softmax_value(x.x, stats), softmax_value(x.y, stats),
                              softmax_value(x.z, stats), softmax_value(x.w, stats));
            dst[(pu(SOFTMAX_DST_OFFSET) + row * k_len + k) / 4u] = v;
        }
        return;
    }
    for (var k = 0u; k < k_len; k = k + 1u) {
        set_dst(row * k_len + k, softmax_value(src_at(base + k), stats));
    }
}

// The cross-entropy of each row (`*_serial`, `*_rows`), as torch's `cross_entropy` with
// `weight`, `ignore_index` and `label_smoothing` (eps) per element, before any reduction:
//   (1 - eps) w[y] (lse - x[y]) + eps / K (lse W - sum_c w[c] x[c]),  W = sum_c w[c],
// lse = logsumexp(row), w = 1 unweighted; 0 for a row whose label is ignore_index.
// The reduction (mean, sum) is the host's, through ops whose grads reach `grad` per row.

fn weight_of(c: u32) -> f32 {
    if (pu(SOFTMAX_WEIGHTED) == 1u) {
        return class_weight[c];
    }
    return 1.0;
}

// The logit of `label` in the row from `base`: an ignored label may lie past the row (a
// marker such as torch's -100), so the read is clamped into it and its value unused.
fn label_logit(base: u32, label: u32) -> f32 {
    return src_at(base + min(label, pu(SOFTMAX_LEN) - 1u));
}

fn ignored(label: u32) -> bool {
    return pu(SOFTMAX_IGNORE) == 1u && label == pu(SOFTMAX_IGNORE_INDEX);
}

// A row's loss from its stats (max, log-sum-exp of the shifted row), its label's logit and,
// under smoothing, (W, sum_c w[c] x[c]).
fn row_loss(stats: vec2<f32>, label: u32, x_label: f32, sums: vec2<f32>) -> f32 {
    if (ignored(label)) {
        return 0.0;
    }
    let lse = stats.x + stats.y;
    let eps = pf(SOFTMAX_SMOOTHING);
    var loss = (1.0 - eps) * weight_of(label) * (lse - x_label);
    if (eps > 0.0) {
        loss = loss + eps / f32(pu(SOFTMAX_LEN)) * (lse * sums.x - sums.y);
    }
    return loss;
}

@compute @workgroup_size(64)
fn cross_entropy_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    for (var g = row_group(wid, nwg, lid); g.row < g.end; g.row = g.row + g.step) {
        cross_entropy_row(g);
    }
}

// One row of `cross_entropy_rows`.
fn cross_entropy_row(g: RowGroup) {
    let row = g.row;
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_group(base, k_len, g);
    var sums = vec2<f32>(0.0);
    if (pf(SOFTMAX_SMOOTHING) > 0.0) {
        var w = 0.0;
        var wx = 0.0;
        for (var k = g.lane; k < k_len; k = k + g.lanes) {
            w = w + weight_of(k);
            wx = wx + weight_of(k) * src_at(base + k);
        }
        sums = vec2<f32>(row_reduce(g, w, false), row_reduce(g, wx, false));
    }
    if (g.lane == 0u) {
        let label = labels[pu(SOFTMAX_LABELS_OFFSET) + row];
        set_dst(row, row_loss(stats, label, label_logit(base, label), sums));
    }
}

@compute @workgroup_size(64)
fn cross_entropy_serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * WG + lid;
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_serial(base, k_len);
    var sums = vec2<f32>(0.0);
    if (pf(SOFTMAX_SMOOTHING) > 0.0) {
        for (var k = 0u; k < k_len; k = k + 1u) {
            sums = sums + vec2<f32>(1.0, src_at(base + k)) * weight_of(k);
        }
    }
    let label = labels[pu(SOFTMAX_LABELS_OFFSET) + row];
    set_dst(row, row_loss(stats, label, label_logit(base, label), sums));
}

// The grad of softmax (or log_softmax) for one element, given the row's sum: for softmax
// dx = y (g - sum(g y)); for log_softmax dx = g - exp(y) sum(g).
fn softmax_grad_value(y: f32, g: f32, sum: f32) -> f32 {
    if (pu(SOFTMAX_LOG) == 1u) {
        return g - exp(y) * sum;
    }
    return y * (g - sum);
}

// What softmax_grad_value needs summed over the row: g y for softmax, g for log_softmax.
fn softmax_grad_term(y: f32, g: f32) -> f32 {
    return select(g * y, g, pu(SOFTMAX_LOG) == 1u);
}

@compute @workgroup_size(64)
fn softmax_backward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    for (var g = row_group(wid, nwg, lid); g.row < g.end; g.row = g.row + g.step) {
        softmax_backward_row(g);
    }
}

// One row of `softmax_backward_rows`.
fn softmax_backward_row(g: RowGroup) {
    let row = g.row;
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    var part = 0.0;
    for (var k = g.lane; k < k_len; k = k + g.lanes) {
        part = part + softmax_grad_term(src_at(base + k), grad_at(row * k_len + k));
    }
    let sum = row_reduce(g, part, false);
    for (var k = g.lane; k < k_len; k = k + g.lanes) {
        let i = row * k_len + k;
        set_dst(i, softmax_grad_value(src_at(base + k), grad_at(i), sum));
    }
}

@compute @workgroup_size(64)
fn softmax_backward_serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * WG + lid;
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    var sum = 0.0;
    for (var k = 0u; k < k_len; k = k + 1u) {
        sum = sum + softmax_grad_term(src_at(base + k), grad_at(row * k_len + k));
    }
    for (var k = 0u; k < k_len; k = k + 1u) {
        let i = row * k_len + k;
        set_dst(i, softmax_grad_value(src_at(base + k), grad_at(i), sum));
    }
}

// d loss_row / d x[c] times the row's incoming grad g (`grad` read through its offset and
// row stride, 0 when the grad is one value broadcast):
//   g ((1 - eps) w[y] (p[c] - [c == y]) + eps / K (p[c] W - w[c])),  p = softmax(row);
// 0 for an ignored row.
fn cross_entropy_grad_value(x: f32, c: u32, stats: vec2<f32>, label: u32, row: u32, w_sum: f32) -> f32 {
    if (ignored(label)) {
        return 0.0;
    }
    let p = exp(x - stats.x - stats.y);
    let eps = pf(SOFTMAX_SMOOTHING);
    var d = (1.0 - eps) * weight_of(label) * (p - select(0.0, 1.0, c == label));
    if (eps > 0.0) {
        d = d + eps / f32(pu(SOFTMAX_LEN)) * (p * w_sum - weight_of(c));
    }
    return d * grad_at(row * pu(SOFTMAX_GRAD_STRIDE));
}

@compute @workgroup_size(64)
fn cross_entropy_backward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    for (var g = row_group(wid, nwg, lid); g.row < g.end; g.row = g.row + g.step) {
        cross_entropy_backward_row(g);
    }
}

// One row of `cross_entropy_backward_rows`.
fn cross_entropy_backward_row(g: RowGroup) {
    let row = g.row;
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_group(base, k_len, g);
    var w_sum = f32(k_len);
    if (pu(SOFTMAX_WEIGHTED) == 1u && pf(SOFTMAX_SMOOTHING) > 0.0) {
        var w = 0.0;
        for (var k = g.lane; k < k_len; k = k + g.lanes) {
            w = w + weight_of(k);
        }
        w_sum = row_reduce(g, w, false);
    }
    let label = labels[pu(SOFTMAX_LABELS_OFFSET) + row];
    for (var k = g.lane; k < k_len; k = k + g.lanes) {
        set_dst(row * k_len + k, cross_entropy_grad_value(src_at(base + k), k, stats, label, row, w_sum));
    }
}

@compute @workgroup_size(64)
fn cross_entropy_backward_serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                                 @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * WG + lid;
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_serial(base, k_len);
    var w_sum = f32(k_len);
    if (pu(SOFTMAX_WEIGHTED) == 1u && pf(SOFTMAX_SMOOTHING) > 0.0) {
        w_sum = 0.0;
        for (var k = 0u; k < k_len; k = k + 1u) {
            w_sum = w_sum + weight_of(k);
        }
    }
    let label = labels[pu(SOFTMAX_LABELS_OFFSET) + row];
    for (var k = 0u; k < k_len; k = k + 1u) {
        set_dst(row * k_len + k, cross_entropy_grad_value(src_at(base + k), k, stats, label, row, w_sum));
    }
}
