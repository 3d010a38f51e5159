// Row-wise softmax, log-softmax and the fused cross-entropy (log-softmax + NLL) of a
// contiguous [M, K] tensor. The row max is subtracted first, so large logits stay finite.
// Two ways to run a row: `*_rows` entries give each row a workgroup of 64 that reduces in
// workgroup memory (GPUs); `*_serial` entries give each row one invocation and no barriers
// (software adapters, where barriers are coroutine switches), reading four elements at a time
// when K and the offset are multiples of 4.
// The backward entries are fused the same way: softmax_backward takes the forward's output y
// and the incoming grad g; cross_entropy_backward recomputes the row's softmax from the logits.
// Params: `SoftmaxParams` (src/ops/softmax.rs).

@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> labels: array<u32>;
@group(0) @binding(4) var<storage, read> grad: array<vec4<f32>>;

const WG: u32 = 64u;
const NEG_INF: f32 = -3.40282347e38;
var<workgroup> scratch: array<f32, 64>;

fn src_at(i: u32) -> f32 {
    return src[i / 4u][i % 4u];
}

fn grad_at(i: u32) -> f32 {
    let at = pu(SOFTMAX_GRAD_OFFSET) + i;
    return grad[at / 4u][at % 4u];
}

fn set_dst(i: u32, v: f32) {
    dst[i / 4u][i % 4u] = v;
}

// The value softmax (or log_softmax) writes for x, given the row's max and log-sum-exp.
fn softmax_value(x: f32, stats: vec2<f32>) -> f32 {
    let shifted = x - stats.x - stats.y;
    if (pu(SOFTMAX_LOG) == 1u) {
        return shifted;
    }
    return exp(shifted);
}

fn workgroup_reduce(lid: u32, v: f32, is_max: bool) -> f32 {
    scratch[lid] = v;
    workgroupBarrier();
    for (var width = WG / 2u; width > 0u; width = width / 2u) {
        if (lid < width) {
            let other = scratch[lid + width];
            scratch[lid] = select(scratch[lid] + other, max(scratch[lid], other), is_max);
        }
        workgroupBarrier();
    }
    let result = scratch[0];
    workgroupBarrier();
    return result;
}

// The row's max and log(sum(exp(x - max))), computed by the whole workgroup.
fn row_stats_workgroup(base: u32, k_len: u32, lid: u32) -> vec2<f32> {
    var m = NEG_INF;
    for (var k = lid; k < k_len; k = k + WG) {
        m = max(m, src_at(base + k));
    }
    m = workgroup_reduce(lid, m, true);
    var s = 0.0;
    for (var k = lid; k < k_len; k = k + WG) {
        s = s + exp(src_at(base + k) - m);
    }
    return vec2<f32>(m, log(workgroup_reduce(lid, s, false)));
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
    let row = workgroup_index(wid, nwg);
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_workgroup(base, k_len, lid);
    for (var k = lid; k < k_len; k = k + WG) {
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
            dst[(row * k_len + k) / 4u] = v;
        }
        return;
    }
    for (var k = 0u; k < k_len; k = k + 1u) {
        set_dst(row * k_len + k, softmax_value(src_at(base + k), stats));
    }
}

// dst[row] = logsumexp(row) - row[label]: the row's negative log-likelihood.
@compute @workgroup_size(64)
fn cross_entropy_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg);
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_workgroup(base, k_len, lid);
    if (lid == 0u) {
        let label = min(labels[pu(SOFTMAX_LABELS_OFFSET) + row], k_len - 1u);
        set_dst(row, stats.x + stats.y - src_at(base + label));
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
    let label = min(labels[pu(SOFTMAX_LABELS_OFFSET) + row], k_len - 1u);
    set_dst(row, stats.x + stats.y - src_at(base + label));
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
    let row = workgroup_index(wid, nwg);
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    var part = 0.0;
    for (var k = lid; k < k_len; k = k + WG) {
        part = part + softmax_grad_term(src_at(base + k), grad_at(row * k_len + k));
    }
    let sum = workgroup_reduce(lid, part, false);
    for (var k = lid; k < k_len; k = k + WG) {
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

// d loss / d logits for loss = mean(cross_entropy): (softmax - one_hot(label)) g / M, with g
// the loss's grad (one element of `grad`).
fn cross_entropy_grad_value(x: f32, stats: vec2<f32>, is_label: bool) -> f32 {
    let p = exp(x - stats.x - stats.y);
    return (p - select(0.0, 1.0, is_label)) * grad_at(0u) * pf(SOFTMAX_SCALE);
}

@compute @workgroup_size(64)
fn cross_entropy_backward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg);
    if (row >= pu(SOFTMAX_ROWS)) {
        return;
    }
    let k_len = pu(SOFTMAX_LEN);
    let base = pu(SOFTMAX_OFFSET) + row * k_len;
    let stats = row_stats_workgroup(base, k_len, lid);
    let label = labels[pu(SOFTMAX_LABELS_OFFSET) + row];
    for (var k = lid; k < k_len; k = k + WG) {
        set_dst(row * k_len + k, cross_entropy_grad_value(src_at(base + k), stats, k == label));
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
    let label = labels[pu(SOFTMAX_LABELS_OFFSET) + row];
    for (var k = 0u; k < k_len; k = k + 1u) {
        set_dst(row * k_len + k, cross_entropy_grad_value(src_at(base + k), stats, k == label));
    }
}
