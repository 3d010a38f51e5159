// Fused optimizer updates: one dispatch per parameter per step, updating the parameter and its
// state in place. Numerics follow PyTorch's SGD, Adam and AdamW.
// Params: `SgdParams` and `AdamParams` in src/optim/mod.rs. Flags: 1 nesterov, 2 first step
// (sgd), 4 decoupled weight decay (adamw).
//
// Each invocation updates four elements at a time (one vec4: software adapters pay per load,
// not per element). The last vec4 of a parameter whose size is not a multiple of 4 is read
// whole (the buffer is larger than the tensor) but only its first n % 4 lanes are stored.
//
// A captured step merges the updates of many parameters into one launch: it repeats the
// MEMBER SECTION once per parameter, with the section's names, bindings and param slots moved
// to that parameter's own (src/capture/passes/merge.rs, `merge_parts`).

fn has_flag(flags: u32, bit: u32) -> bool {
    return (flags & bit) != 0u;
}

// Vec4s one workgroup updates, and each invocation (see contiguous_item).
const VEC4S_PER_GROUP: u32 = CONTIGUOUS_PER_GROUP / 4u;
const VEC4S_PER_INVOCATION: u32 = VEC4S_PER_GROUP / 256u;

// How many vec4s hold the `n` elements.
fn units(n: u32) -> u32 {
    return (n + 3u) / 4u;
}

// How many lanes of vec4 `u` lie inside a tensor of `n` elements.
fn lanes(u: u32, n: u32) -> u32 {
    return min(n - 4u * u, 4u);
}

// MEMBER SECTION BEGIN
@group(0) @binding(1) var<storage, read_write> param: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> grad: array<vec4<f32>>;
// sgd: the momentum buffer. adam: the first moment.
@group(0) @binding(3) var<storage, read_write> state1: array<vec4<f32>>;
// adam: the second moment.
@group(0) @binding(4) var<storage, read_write> state2: array<vec4<f32>>;

// Stores the lanes of vec4 `u` that lie inside a tensor of `n` elements (one function per
// buffer: an entry point binds only the buffers it touches).
fn store_param(u: u32, n: u32, v: vec4<f32>) {
    let k = lanes(u, n);
    if (k == 4u) {
        param[u] = v;
        return;
    }
    for (var j = 0u; j < k; j = j + 1u) {
        param[u][j] = v[j];
    }
}

fn store_state1(u: u32, n: u32, v: vec4<f32>) {
    let k = lanes(u, n);
    if (k == 4u) {
        state1[u] = v;
        return;
    }
    for (var j = 0u; j < k; j = j + 1u) {
        state1[u][j] = v[j];
    }
}

fn store_state2(u: u32, n: u32, v: vec4<f32>) {
    let k = lanes(u, n);
    if (k == 4u) {
        state2[u] = v;
        return;
    }
    for (var j = 0u; j < k; j = j + 1u) {
        state2[u][j] = v[j];
    }
}

// SGD without momentum: p -= lr (g + wd p). `w` is the workgroup.
fn sgd_part(w: u32, lid: u32) {
    let n = pu(SGD_N);
    let lr = pf(SGD_LR);
    let wd = pf(SGD_WEIGHT_DECAY);
    for (var j = 0u; j < rolled(VEC4S_PER_INVOCATION); j = j + 1u) {
        let u = contiguous_item_at(w, lid, j, VEC4S_PER_GROUP);
        if (u >= units(n)) {
            break;
        }
        let p = param[u];
        store_param(u, n, p - lr * (grad[u] + wd * p));
    }
}

// SGD with momentum (and optionally Nesterov): buf = g on the first step, else
// momentum buf + (1 - dampening) g; then p -= lr (nesterov ? g + momentum buf : buf).
fn sgd_momentum_part(w: u32, lid: u32) {
    let n = pu(SGD_N);
    let lr = pf(SGD_LR);
    let wd = pf(SGD_WEIGHT_DECAY);
    let momentum = pf(SGD_MOMENTUM);
    let dampening = pf(SGD_DAMPENING);
    let nesterov = has_flag(pu(SGD_FLAGS), 1u);
    let first_step = has_flag(pu(SGD_FLAGS), 2u);
    for (var j = 0u; j < rolled(VEC4S_PER_INVOCATION); j = j + 1u) {
        let u = contiguous_item_at(w, lid, j, VEC4S_PER_GROUP);
        if (u >= units(n)) {
            break;
        }
        let p = param[u];
        let g = grad[u] + wd * p;
        var buf = g;
        if (!first_step) {
            buf = momentum * state1[u] + (1.0 - dampening) * g;
        }
        store_state1(u, n, buf);
        var step = buf;
        if (nesterov) {
            step = g + momentum * buf;
        }
        store_param(u, n, p - lr * step);
    }
}

// Adam (weight decay added to the grad) and AdamW (weight decay applied to the parameter).
fn adam_part(w: u32, lid: u32) {
    let n = pu(ADAM_N);
    let lr = pf(ADAM_LR);
    let wd = pf(ADAM_WEIGHT_DECAY);
    let beta1 = pf(ADAM_BETA1);
    let beta2 = pf(ADAM_BETA2);
    let eps = pf(ADAM_EPS);
    let step_size = lr / pf(ADAM_BIAS_CORRECTION1);
    let sqrt_bc2 = sqrt(pf(ADAM_BIAS_CORRECTION2));
    let decoupled = has_flag(pu(ADAM_FLAGS), 4u);
    for (var j = 0u; j < rolled(VEC4S_PER_INVOCATION); j = j + 1u) {
        let u = contiguous_item_at(w, lid, j, VEC4S_PER_GROUP);
        if (u >= units(n)) {
            break;
        }
        var p = param[u];
        var g = grad[u];
        if (decoupled) {
            p = p * (1.0 - lr * wd);
        } else {
            g = g + wd * p;
        }
        let m = beta1 * state1[u] + (1.0 - beta1) * g;
        let v = beta2 * state2[u] + (1.0 - beta2) * g * g;
        store_state1(u, n, m);
        store_state2(u, n, v);
        store_param(u, n, p - step_size * m / (sqrt(v) / sqrt_bc2 + eps));
    }
}
// MEMBER SECTION END

@compute @workgroup_size(256)
fn sgd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    sgd_part(workgroup_index(wid, nwg), lid);
}

@compute @workgroup_size(256)
fn sgd_momentum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    sgd_momentum_part(workgroup_index(wid, nwg), lid);
}

@compute @workgroup_size(256)
fn adam(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    adam_part(workgroup_index(wid, nwg), lid);
}
