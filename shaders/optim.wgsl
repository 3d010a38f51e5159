// Fused optimizer updates: one dispatch per parameter per step (a captured step merges them,
// see the UPDATE SECTION), updating the parameter and its state in place. Numerics follow PyTorch's SGD, Adam and AdamW.
// Params: `SgdParams` and `AdamParams` in src/optim/mod.rs. Flags: 1 nesterov, 2 first step
// (sgd), 4 decoupled weight decay (adamw).
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

// UPDATE SECTION BEGIN
// What the updates share with a captured step's merged update (src/optim/mod.rs builds it
// from this section): no bindings, and params read from slot `base` on (0 here; each
// parameter of a merged update has a block of its own).

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

// A parameter's new value and state.
struct Updated {
    p: vec4<f32>,
    s1: vec4<f32>,
    s2: vec4<f32>,
}

// SGD without momentum: p -= lr (g + wd p).
fn sgd_math(base: u32, p: vec4<f32>, g: vec4<f32>) -> Updated {
    let lr = pf(base + SGD_LR);
    let wd = pf(base + SGD_WEIGHT_DECAY);
    return Updated(p - lr * (g + wd * p), vec4<f32>(), vec4<f32>());
}

// SGD with momentum (and optionally Nesterov): buf = g on the first step, else
// momentum buf + (1 - dampening) g; then p -= lr (nesterov ? g + momentum buf : buf).
fn sgd_momentum_math(base: u32, p: vec4<f32>, grad: vec4<f32>, old_buf: vec4<f32>) -> Updated {
    let lr = pf(base + SGD_LR);
    let momentum = pf(base + SGD_MOMENTUM);
    let g = grad + pf(base + SGD_WEIGHT_DECAY) * p;
    var buf = g;
    if (!has_flag(pu(base + SGD_FLAGS), 2u)) {
        buf = momentum * old_buf + (1.0 - pf(base + SGD_DAMPENING)) * g;
    }
    var step = buf;
    if (has_flag(pu(base + SGD_FLAGS), 1u)) {
        step = g + momentum * buf;
    }
    return Updated(p - lr * step, buf, vec4<f32>());
}

// Adam (weight decay added to the grad) and AdamW (weight decay applied to the parameter).
fn adam_math(base: u32, param: vec4<f32>, grad: vec4<f32>, m: vec4<f32>, v: vec4<f32>) -> Updated {
    let lr = pf(base + ADAM_LR);
    let wd = pf(base + ADAM_WEIGHT_DECAY);
    let beta1 = pf(base + ADAM_BETA1);
    let beta2 = pf(base + ADAM_BETA2);
    var p = param;
    var g = grad;
    if (has_flag(pu(base + ADAM_FLAGS), 4u)) {
        p = p * (1.0 - lr * wd);
    } else {
        g = g + wd * p;
    }
    let m_new = beta1 * m + (1.0 - beta1) * g;
    let v_new = beta2 * v + (1.0 - beta2) * g * g;
    let step_size = lr / pf(base + ADAM_BIAS_CORRECTION1);
    let denom = sqrt(v_new) / sqrt(pf(base + ADAM_BIAS_CORRECTION2)) + pf(base + ADAM_EPS);
    return Updated(p - step_size * m_new / denom, m_new, v_new);
}
// UPDATE SECTION END

fn unit(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, j: u32) -> u32 {
    return contiguous_item(wid, nwg, lid, j, VEC4S_PER_GROUP);
}

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

@compute @workgroup_size(256)
fn sgd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let n = pu(SGD_N);
    for (var j = 0u; j < VEC4S_PER_INVOCATION; j = j + 1u) {
        let u = unit(wid, nwg, lid, j);
        if (u >= units(n)) {
            break;
        }
        store_param(u, n, sgd_math(0u, param[u], grad[u]).p);
    }
}

@compute @workgroup_size(256)
fn sgd_momentum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let n = pu(SGD_N);
    for (var j = 0u; j < VEC4S_PER_INVOCATION; j = j + 1u) {
        let u = unit(wid, nwg, lid, j);
        if (u >= units(n)) {
            break;
        }
        let r = sgd_momentum_math(0u, param[u], grad[u], state1[u]);
        store_state1(u, n, r.s1);
        store_param(u, n, r.p);
    }
}

@compute @workgroup_size(256)
fn adam(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n = pu(ADAM_N);
    for (var j = 0u; j < VEC4S_PER_INVOCATION; j = j + 1u) {
        let u = unit(wid, nwg, lid, j);
        if (u >= units(n)) {
            break;
        }
        let r = adam_math(0u, param[u], grad[u], state1[u], state2[u]);
        store_state1(u, n, r.s1);
        store_state2(u, n, r.s2);
        store_param(u, n, r.p);
    }
}
