// Scaled dot-product attention, fused: softmax(q k^T * scale) v without storing the Tq x Tk
// scores. The forward keeps a running max and sum per query row (online softmax, as
// flash-attention) and saves each row's log-sum-exp; the backward recomputes the scores from
// it. Params: `AttentionParams` (src/ops/attention.rs). q, k, v, the out grad and the outputs
// are contiguous [rows, features]; `heads` (batch x heads) stacks Tq query rows and Tk key rows
// each.
//
// One invocation owns one query row (forward, query grad) or one key row (key and value
// grads) and loops over the other side in spans of `span` rows, split `splits` ways across
// invocations, so that no invocation runs more loop iterations than llvmpipe allows (65,535);
// each split writes its own partial result and the host (or `combine`) adds them up. Rows are
// read four features at a time, zero-padded past the row's end.

@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
// forward: out [splits, rows, dv] (normalised when splits == 1, else the unnormalised sums).
// backward: the out grad.
@group(0) @binding(4) var<storage, read_write> o: array<f32>;
// forward: [splits, rows, 2] running (max, sum), or [rows, 2] (log-sum-exp, 0) when
// splits == 1. backward: [rows, 2] (log-sum-exp, rowsum(out grad * out)).
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
// query grad [splits, Tq rows, d]; key grad [splits, Tk rows, d].
@group(0) @binding(6) var<storage, read_write> grad_a: array<f32>;
// value grad [splits, Tk rows, dv].
@group(0) @binding(7) var<storage, read_write> grad_b: array<f32>;

const MAX_VEC4S: u32 = 64u;

// 1 for the lanes of features i..i+4 inside a row of `len`, else 0.
fn masked(i: u32, len: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), vec4<f32>(1.0), vec4<u32>(i) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(len));
}

fn q4(row: u32, c: u32) -> vec4<f32> {
    let len = pu(ATTENTION_D);
    let at = pu(ATTENTION_Q_OFFSET) + row * len + 4u * c;
    return vec4<f32>(q[at], q[at + 1u], q[at + 2u], q[at + 3u]) * masked(4u * c, len);
}

fn k4(row: u32, c: u32) -> vec4<f32> {
    let len = pu(ATTENTION_D);
    let at = pu(ATTENTION_K_OFFSET) + row * len + 4u * c;
    return vec4<f32>(k[at], k[at + 1u], k[at + 2u], k[at + 3u]) * masked(4u * c, len);
}

fn v4(row: u32, c: u32) -> vec4<f32> {
    let len = pu(ATTENTION_DV);
    let at = pu(ATTENTION_V_OFFSET) + row * len + 4u * c;
    return vec4<f32>(v[at], v[at + 1u], v[at + 2u], v[at + 3u]) * masked(4u * c, len);
}

// The out grad's row (bound at `o` in the backward).
fn dout4(row: u32, c: u32) -> vec4<f32> {
    let len = pu(ATTENTION_DV);
    let at = pu(ATTENTION_O_OFFSET) + row * len + 4u * c;
    return vec4<f32>(o[at], o[at + 1u], o[at + 2u], o[at + 3u]) * masked(4u * c, len);
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

@compute @workgroup_size(64)
fn forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let t = workgroup_index(wid, nwg) * 64u + lid;
    let rows = pu(ATTENTION_ROWS);
    let splits = pu(ATTENTION_SPLITS);
    if (t >= rows * splits) {
        return;
    }
    let row = t % rows;
    let s = t / rows;
    let t_q = pu(ATTENTION_T_Q);
    let t_k = pu(ATTENTION_T_K);
    let key_base = (row / t_q) * t_k;
    let d4 = (pu(ATTENTION_D) + 3u) / 4u;
    let dv = pu(ATTENTION_DV);
    let dv4 = (dv + 3u) / 4u;
    let scale = pf(ATTENTION_SCALE);
    var query: array<vec4<f32>, MAX_VEC4S>;
    for (var c = 0u; c < d4; c = c + 1u) {
        query[c] = q4(row, c) * scale;
    }
    var acc: array<vec4<f32>, MAX_VEC4S>;
    for (var c = 0u; c < dv4; c = c + 1u) {
        acc[c] = vec4<f32>(0.0);
    }
    var m = bitcast<f32>(0xff800000u);
    var l = 0.0;
    let keys = key_range(row % t_q, s);
    for (var j = keys.x; j < keys.y; j = j + 1u) {
        var score = 0.0;
        for (var c = 0u; c < d4; c = c + 1u) {
            score = score + dot(query[c], k4(key_base + j, c));
        }
        let m_new = max(m, score);
        let correction = exp(m - m_new);
        let p = exp(score - m_new);
        l = l * correction + p;
        for (var c = 0u; c < dv4; c = c + 1u) {
            acc[c] = acc[c] * correction + p * v4(key_base + j, c);
        }
        m = m_new;
    }
    let out_base = (s * rows + row) * dv;
    if (splits == 1u) {
        // A row with no key (causal, Tq > Tk) has l = 0: its output is 0, as a 0 / 0 would not be.
        let inv = select(0.0, 1.0 / l, l > 0.0);
        for (var c = 0u; c < dv4; c = c + 1u) {
            for (var e = 0u; e < lanes(c, dv); e = e + 1u) {
            o[out_base + 4u * c + e] = (acc[c] * inv)[e];
        }
        }
        stats[2u * row] = m + log(l);
        stats[2u * row + 1u] = 0.0;
        return;
    }
    for (var c = 0u; c < dv4; c = c + 1u) {
        for (var e = 0u; e < lanes(c, dv); e = e + 1u) {
            o[out_base + 4u * c + e] = (acc[c])[e];
        }
    }
    stats[2u * (s * rows + row)] = m;
    stats[2u * (s * rows + row) + 1u] = l;
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
    var m = bitcast<f32>(0xff800000u);
    for (var s = 0u; s < splits; s = s + 1u) {
        m = max(m, k[2u * (s * rows + row)]);
    }
    var l = 0.0;
    for (var s = 0u; s < splits; s = s + 1u) {
        let at = 2u * (s * rows + row);
        l = l + k[at + 1u] * select(0.0, exp(k[at] - m), k[at + 1u] > 0.0);
    }
    let inv = select(0.0, 1.0 / l, l > 0.0);
    for (var c = 0u; c < dv; c = c + 1u) {
        var sum = 0.0;
        for (var s = 0u; s < splits; s = s + 1u) {
            let at = 2u * (s * rows + row);
            sum = sum + v[(s * rows + row) * dv + c] * select(0.0, exp(k[at] - m), k[at + 1u] > 0.0);
        }
        o[row * dv + c] = sum * inv;
    }
    stats[2u * row] = m + log(l);
    stats[2u * row + 1u] = 0.0;
}

// The query grad: dq_i = scale * sum_j p_ij (dout_i . v_j - delta_i) k_j, where
// p_ij = exp(scale q_i . k_j - lse_i) and delta_i = dout_i . out_i.
@compute @workgroup_size(64)
fn backward_query(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let t = workgroup_index(wid, nwg) * 64u + lid;
    let rows = pu(ATTENTION_ROWS);
    let splits = pu(ATTENTION_SPLITS);
    if (t >= rows * splits) {
        return;
    }
    let row = t % rows;
    let s = t / rows;
    let t_q = pu(ATTENTION_T_Q);
    let t_k = pu(ATTENTION_T_K);
    let key_base = (row / t_q) * t_k;
    let d = pu(ATTENTION_D);
    let d4 = (d + 3u) / 4u;
    let dv4 = (pu(ATTENTION_DV) + 3u) / 4u;
    let scale = pf(ATTENTION_SCALE);
    var query: array<vec4<f32>, MAX_VEC4S>;
    var grad: array<vec4<f32>, MAX_VEC4S>;
    for (var c = 0u; c < d4; c = c + 1u) {
        query[c] = q4(row, c) * scale;
        grad[c] = vec4<f32>(0.0);
    }
    var dout: array<vec4<f32>, MAX_VEC4S>;
    for (var c = 0u; c < dv4; c = c + 1u) {
        dout[c] = dout4(row, c);
    }
    let lse = stats[2u * row];
    let delta = stats[2u * row + 1u];
    let keys = key_range(row % t_q, s);
    for (var j = keys.x; j < keys.y; j = j + 1u) {
        var score = 0.0;
        for (var c = 0u; c < d4; c = c + 1u) {
            score = score + dot(query[c], k4(key_base + j, c));
        }
        var dp = 0.0;
        for (var c = 0u; c < dv4; c = c + 1u) {
            dp = dp + dot(dout[c], v4(key_base + j, c));
        }
        let ds = exp(score - lse) * (dp - delta) * scale;
        for (var c = 0u; c < d4; c = c + 1u) {
            grad[c] = grad[c] + ds * k4(key_base + j, c);
        }
    }
    let base = (s * rows + row) * d;
    for (var c = 0u; c < d4; c = c + 1u) {
        for (var e = 0u; e < lanes(c, d); e = e + 1u) {
            grad_a[base + 4u * c + e] = (grad[c])[e];
        }
    }
}

// The key and value grads: dk_j = scale * sum_i p_ij (dout_i . v_j - delta_i) q_i and
// dv_j = sum_i p_ij dout_i. `rows` counts key rows here.
@compute @workgroup_size(64)
fn backward_key(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let t = workgroup_index(wid, nwg) * 64u + lid;
    let rows = pu(ATTENTION_ROWS);
    let splits = pu(ATTENTION_SPLITS);
    if (t >= rows * splits) {
        return;
    }
    let row = t % rows;
    let s = t / rows;
    let t_q = pu(ATTENTION_T_Q);
    let t_k = pu(ATTENTION_T_K);
    let query_base = (row / t_k) * t_q;
    let d = pu(ATTENTION_D);
    let d4 = (d + 3u) / 4u;
    let dv = pu(ATTENTION_DV);
    let dv4 = (dv + 3u) / 4u;
    let scale = pf(ATTENTION_SCALE);
    var key: array<vec4<f32>, MAX_VEC4S>;
    var grad_key: array<vec4<f32>, MAX_VEC4S>;
    for (var c = 0u; c < d4; c = c + 1u) {
        key[c] = k4(row, c) * scale;
        grad_key[c] = vec4<f32>(0.0);
    }
    var value: array<vec4<f32>, MAX_VEC4S>;
    var grad_value: array<vec4<f32>, MAX_VEC4S>;
    for (var c = 0u; c < dv4; c = c + 1u) {
        value[c] = v4(row, c);
        grad_value[c] = vec4<f32>(0.0);
    }
    let queries = query_range(row % t_k, s);
    for (var i = queries.x; i < queries.y; i = i + 1u) {
        let qi = query_base + i;
        var score = 0.0;
        for (var c = 0u; c < d4; c = c + 1u) {
            score = score + dot(key[c], q4(qi, c));
        }
        let p = exp(score - stats[2u * qi]);
        var dp = 0.0;
        for (var c = 0u; c < dv4; c = c + 1u) {
            let g = dout4(qi, c);
            dp = dp + dot(g, value[c]);
            grad_value[c] = grad_value[c] + p * g;
        }
        let ds = p * (dp - stats[2u * qi + 1u]) * scale;
        for (var c = 0u; c < d4; c = c + 1u) {
            grad_key[c] = grad_key[c] + ds * q4(qi, c);
        }
    }
    for (var c = 0u; c < d4; c = c + 1u) {
        for (var e = 0u; e < lanes(c, d); e = e + 1u) {
            grad_a[(s * rows + row) * d + 4u * c + e] = (grad_key[c])[e];
        }
    }
    for (var c = 0u; c < dv4; c = c + 1u) {
        for (var e = 0u; e < lanes(c, dv); e = e + 1u) {
            grad_b[(s * rows + row) * dv + 4u * c + e] = (grad_value[c])[e];
        }
    }
}
