// Row-wise softmax, log-softmax and the fused cross-entropy (log-softmax + NLL) of a
// contiguous [M, K] tensor. One workgroup per row; the max is subtracted first, so large
// logits stay finite.
// params: 0 M, 1 K, 2 src offset, 3 labels offset

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> labels: array<u32>;

const WG: u32 = 64u;
var<workgroup> scratch: array<f32, 64>;

fn workgroup_max(lid: u32, v: f32) -> f32 {
    scratch[lid] = v;
    workgroupBarrier();
    for (var width = WG / 2u; width > 0u; width = width / 2u) {
        if (lid < width) {
            scratch[lid] = max(scratch[lid], scratch[lid + width]);
        }
        workgroupBarrier();
    }
    let result = scratch[0];
    workgroupBarrier();
    return result;
}

fn workgroup_sum(lid: u32, v: f32) -> f32 {
    scratch[lid] = v;
    workgroupBarrier();
    for (var width = WG / 2u; width > 0u; width = width / 2u) {
        if (lid < width) {
            scratch[lid] = scratch[lid] + scratch[lid + width];
        }
        workgroupBarrier();
    }
    let result = scratch[0];
    workgroupBarrier();
    return result;
}

// The row's max and log(sum(exp(x - max))).
fn row_stats(base: u32, k_len: u32, lid: u32) -> vec2<f32> {
    var m = bitcast<f32>(0xff800000u);
    for (var k = lid; k < k_len; k = k + WG) {
        m = max(m, src[base + k]);
    }
    m = workgroup_max(lid, m);
    var s = 0.0;
    for (var k = lid; k < k_len; k = k + WG) {
        s = s + exp(src[base + k] - m);
    }
    return vec2<f32>(m, log(workgroup_sum(lid, s)));
}

@compute @workgroup_size(64)
fn softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg);
    if (row >= pu(0u)) {
        return;
    }
    let k_len = pu(1u);
    let base = pu(2u) + row * k_len;
    let stats = row_stats(base, k_len, lid);
    for (var k = lid; k < k_len; k = k + WG) {
        dst[row * k_len + k] = exp(src[base + k] - stats.x - stats.y);
    }
}

@compute @workgroup_size(64)
fn log_softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg);
    if (row >= pu(0u)) {
        return;
    }
    let k_len = pu(1u);
    let base = pu(2u) + row * k_len;
    let stats = row_stats(base, k_len, lid);
    for (var k = lid; k < k_len; k = k + WG) {
        dst[row * k_len + k] = src[base + k] - stats.x - stats.y;
    }
}

// dst[row] = logsumexp(row) - row[label]: the row's negative log-likelihood.
@compute @workgroup_size(64)
fn cross_entropy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg);
    if (row >= pu(0u)) {
        return;
    }
    let k_len = pu(1u);
    let base = pu(2u) + row * k_len;
    let stats = row_stats(base, k_len, lid);
    if (lid == 0u) {
        let label = min(labels[pu(3u) + row], k_len - 1u);
        dst[row] = stats.x + stats.y - src[base + label];
    }
}
