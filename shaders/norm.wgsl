// LayerNorm over the last dim, fused: one invocation per row. Params: `NormParams`
// (src/ops/norm.rs). x, the out grad and every output are contiguous [rows, len].

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
// forward: the output. backward: the input grad.
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// [rows, 2]: mean and 1 / sqrt(var + eps) of each row (written forward, read backward).
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
// backward: the out grad.
@group(0) @binding(6) var<storage, read> grad: array<f32>;
// backward: grad * xhat per element, summed over rows by the host into the weight grad.
@group(0) @binding(7) var<storage, read_write> grad_xhat: array<f32>;

// EPILOGUE SECTION BEGIN
// How the forward stores out[o]. A captured step's fuser replaces this section with a store
// that first runs the elementwise ops consuming the output (an activation, a residual add), so
// that they cost no pass of their own (src/capture/fuse.rs).
fn store1(o: u32, v: f32) {
    out[o] = v;
}
// EPILOGUE SECTION END

// y = (x - mean) / sqrt(var + eps) * weight + bias, var biased (as PyTorch).
@compute @workgroup_size(64)
fn forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 64u + lid;
    if (row >= pu(NORM_ROWS)) {
        return;
    }
    let len = pu(NORM_LEN);
    let base = pu(NORM_X_OFFSET) + row * len;
    var sum = 0.0;
    for (var i = 0u; i < len; i = i + 1u) {
        sum = sum + x[base + i];
    }
    let mean = sum / f32(len);
    var squares = 0.0;
    for (var i = 0u; i < len; i = i + 1u) {
        let c = x[base + i] - mean;
        squares = squares + c * c;
    }
    let rstd = inverseSqrt(squares / f32(len) + pf(NORM_EPS));
    let w_at = pu(NORM_WEIGHT_OFFSET);
    let b_at = pu(NORM_BIAS_OFFSET);
    for (var i = 0u; i < len; i = i + 1u) {
        store1(row * len + i, (x[base + i] - mean) * rstd * weight[w_at + i] + bias[b_at + i]);
    }
    stats[2u * row] = mean;
    stats[2u * row + 1u] = rstd;
}

// dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) with gw = grad * weight and
// xhat = (x - mean) * rstd; also grad * xhat, for the weight grad.
@compute @workgroup_size(64)
fn backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 64u + lid;
    if (row >= pu(NORM_ROWS)) {
        return;
    }
    let len = pu(NORM_LEN);
    let base = pu(NORM_X_OFFSET) + row * len;
    let g_base = pu(NORM_GRAD_OFFSET) + row * len;
    let w_at = pu(NORM_WEIGHT_OFFSET);
    let mean = stats[2u * row];
    let rstd = stats[2u * row + 1u];
    var sum_gw = 0.0;
    var sum_gw_xhat = 0.0;
    for (var i = 0u; i < len; i = i + 1u) {
        let xhat = (x[base + i] - mean) * rstd;
        let g = grad[g_base + i];
        let gw = g * weight[w_at + i];
        sum_gw = sum_gw + gw;
        sum_gw_xhat = sum_gw_xhat + gw * xhat;
        grad_xhat[row * len + i] = g * xhat;
    }
    let mean_gw = sum_gw / f32(len);
    let mean_gw_xhat = sum_gw_xhat / f32(len);
    for (var i = 0u; i < len; i = i + 1u) {
        let xhat = (x[base + i] - mean) * rstd;
        let gw = grad[g_base + i] * weight[w_at + i];
        out[row * len + i] = rstd * (gw - mean_gw - xhat * mean_gw_xhat);
    }
}
