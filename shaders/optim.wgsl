// Fused optimizer updates: one dispatch per parameter per step, updating the parameter and its
// state in place. Numerics follow PyTorch's SGD, Adam and AdamW.
// params: 0 n, 1 lr, 2 weight decay, 3 momentum (sgd) or beta1, 4 dampening (sgd) or beta2,
//         5 eps, 6 1 - beta1^t, 7 1 - beta2^t, 8 flags: 1 nesterov, 2 first step (sgd),
//         4 decoupled weight decay (adamw); all f32 except 0 and 8

@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
// sgd: the momentum buffer. adam: the first moment.
@group(0) @binding(3) var<storage, read_write> state1: array<f32>;
// adam: the second moment.
@group(0) @binding(4) var<storage, read_write> state2: array<f32>;

fn has_flag(bit: u32) -> bool {
    return (pu(8u) & bit) != 0u;
}

fn element_range(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> vec2<u32> {
    let start = workgroup_index(wid, nwg) * CONTIGUOUS_PER_GROUP + lid;
    return vec2<u32>(start, min(start + CONTIGUOUS_PER_GROUP, pu(0u)));
}

// SGD without momentum: p -= lr (g + wd p).
@compute @workgroup_size(256)
fn sgd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let range = element_range(wid, nwg, lid);
    for (var i = range.x; i < range.y; i = i + 256u) {
        let p = param[i];
        param[i] = p - pf(1u) * (grad[i] + pf(2u) * p);
    }
}

// SGD with momentum (and optionally Nesterov): buf = g on the first step, else
// momentum buf + (1 - dampening) g; then p -= lr (nesterov ? g + momentum buf : buf).
@compute @workgroup_size(256)
fn sgd_momentum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let range = element_range(wid, nwg, lid);
    let momentum = pf(3u);
    for (var i = range.x; i < range.y; i = i + 256u) {
        let p = param[i];
        let g = grad[i] + pf(2u) * p;
        var buf = g;
        if (!has_flag(2u)) {
            buf = momentum * state1[i] + (1.0 - pf(4u)) * g;
        }
        state1[i] = buf;
        var step = buf;
        if (has_flag(1u)) {
            step = g + momentum * buf;
        }
        param[i] = p - pf(1u) * step;
    }
}

// Adam (weight decay added to the grad) and AdamW (weight decay applied to the parameter).
@compute @workgroup_size(256)
fn adam(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let range = element_range(wid, nwg, lid);
    let lr = pf(1u);
    let wd = pf(2u);
    let beta1 = pf(3u);
    let beta2 = pf(4u);
    let step_size = lr / pf(6u);
    let sqrt_bc2 = sqrt(pf(7u));
    for (var i = range.x; i < range.y; i = i + 256u) {
        var p = param[i];
        var g = grad[i];
        if (has_flag(4u)) {
            p = p * (1.0 - lr * wd);
        } else {
            g = g + wd * p;
        }
        let m = beta1 * state1[i] + (1.0 - beta1) * g;
        let v = beta2 * state2[i] + (1.0 - beta2) * g * g;
        state1[i] = m;
        state2[i] = v;
        param[i] = p - step_size * m / (sqrt(v) / sqrt_bc2 + pf(5u));
    }
}
