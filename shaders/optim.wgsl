// Fused optimizer updates: one dispatch per parameter per step, updating the parameter and its
// state in place. Numerics follow PyTorch's SGD, Adam and AdamW.
// params: 0 n, 1 lr, 2 weight decay, 3 momentum (sgd) or beta1, 4 dampening (sgd) or beta2,
//         5 eps, 6 1 - beta1^t, 7 1 - beta2^t, 8 flags: 1 nesterov, 2 first step (sgd),
//         4 decoupled weight decay (adamw); all f32 except 0 and 8
//
// Each invocation updates four elements at a time (one vec4: software adapters pay per load,
// not per element). The last vec4 of a parameter whose size is not a multiple of 4 is read
// whole (the buffer is larger than the tensor) but only its first n % 4 lanes are stored.

@group(0) @binding(1) var<storage, read_write> param: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> grad: array<vec4<f32>>;
// sgd: the momentum buffer. adam: the first moment.
@group(0) @binding(3) var<storage, read_write> state1: array<vec4<f32>>;
// adam: the second moment.
@group(0) @binding(4) var<storage, read_write> state2: array<vec4<f32>>;

fn has_flag(bit: u32) -> bool {
    return (pu(8u) & bit) != 0u;
}

// The vec4s this invocation updates: [x, y).
fn unit_range(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> vec2<u32> {
    let per_group = CONTIGUOUS_PER_GROUP / 4u;
    let start = workgroup_index(wid, nwg) * per_group + lid;
    return vec2<u32>(start, min(start + per_group, (pu(0u) + 3u) / 4u));
}

// How many lanes of vec4 `u` lie inside the tensor.
fn lanes(u: u32) -> u32 {
    return min(pu(0u) - 4u * u, 4u);
}

fn store_param(u: u32, v: vec4<f32>) {
    let k = lanes(u);
    if (k == 4u) {
        param[u] = v;
        return;
    }
    for (var j = 0u; j < k; j = j + 1u) {
        param[u][j] = v[j];
    }
}

fn store_state1(u: u32, v: vec4<f32>) {
    let k = lanes(u);
    if (k == 4u) {
        state1[u] = v;
        return;
    }
    for (var j = 0u; j < k; j = j + 1u) {
        state1[u][j] = v[j];
    }
}

fn store_state2(u: u32, v: vec4<f32>) {
    let k = lanes(u);
    if (k == 4u) {
        state2[u] = v;
        return;
    }
    for (var j = 0u; j < k; j = j + 1u) {
        state2[u][j] = v[j];
    }
}

// SGD without momentum: p -= lr (g + wd p).
@compute @workgroup_size(256)
fn sgd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let range = unit_range(wid, nwg, lid);
    for (var u = range.x; u < range.y; u = u + 256u) {
        let p = param[u];
        store_param(u, p - pf(1u) * (grad[u] + pf(2u) * p));
    }
}

// SGD with momentum (and optionally Nesterov): buf = g on the first step, else
// momentum buf + (1 - dampening) g; then p -= lr (nesterov ? g + momentum buf : buf).
@compute @workgroup_size(256)
fn sgd_momentum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let range = unit_range(wid, nwg, lid);
    let momentum = pf(3u);
    for (var u = range.x; u < range.y; u = u + 256u) {
        let p = param[u];
        let g = grad[u] + pf(2u) * p;
        var buf = g;
        if (!has_flag(2u)) {
            buf = momentum * state1[u] + (1.0 - pf(4u)) * g;
        }
        store_state1(u, buf);
        var step = buf;
        if (has_flag(1u)) {
            step = g + momentum * buf;
        }
        store_param(u, p - pf(1u) * step);
    }
}

// Adam (weight decay added to the grad) and AdamW (weight decay applied to the parameter).
@compute @workgroup_size(256)
fn adam(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let range = unit_range(wid, nwg, lid);
    let lr = pf(1u);
    let wd = pf(2u);
    let beta1 = pf(3u);
    let beta2 = pf(4u);
    let step_size = lr / pf(6u);
    let sqrt_bc2 = sqrt(pf(7u));
    for (var u = range.x; u < range.y; u = u + 256u) {
        var p = param[u];
        var g = grad[u];
        if (has_flag(4u)) {
            p = p * (1.0 - lr * wd);
        } else {
            g = g + wd * p;
        }
        let m = beta1 * state1[u] + (1.0 - beta1) * g;
        let v = beta2 * state2[u] + (1.0 - beta2) * g * g;
        store_state1(u, m);
        store_state2(u, v);
        store_param(u, p - step_size * m / (sqrt(v) / sqrt_bc2 + pf(5u)));
    }
}
