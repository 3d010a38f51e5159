// Rotary position embeddings, the Hugging Face Llama convention: a head of `dim` features is
// two halves, and feature j < half turns with feature j + half by the angle
// position * theta^(-2 j / dim) ("rotate_half"). Params: `RopeParams` (src/ops/rope.rs).

// table: [max_positions, half] cosines, then as many sines (built once by `build_table`).
@group(0) @binding(1) var<storage, read_write> table: array<f32>;
// apply: x and out are contiguous [rows, dim]; row r is at position first + r % seq.
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const TWO_PI: f32 = 6.283185307179586;

// One invocation per (position, j): cos and sin of position * theta^(-2 j / dim), the angle
// first taken to [-pi, pi] (GPU sin and cos are only specified there).
@compute @workgroup_size(256)
fn build_table(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let half = pu(ROPE_HALF);
    let n = pu(ROPE_POSITIONS) * half;
    if (i >= n) {
        return;
    }
    let position = f32(i / half);
    let j = f32(i % half);
    let inv_freq = 1.0 / pow(pf(ROPE_THETA), 2.0 * j / f32(2u * half));
    let angle = position * inv_freq;
    let turned = angle - TWO_PI * round(angle / TWO_PI);
    table[i] = cos(turned);
    table[n + i] = sin(turned);
}

// One invocation per pair (row, j < half): the pair turned by its angle, or back by it for
// the backward pass (SIGN -1: the transpose of a rotation is the rotation back).
@compute @workgroup_size(256)
fn apply(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    let half = pu(ROPE_HALF);
    if (i >= pu(ROPE_ROWS) * half) {
        return;
    }
    let row = i / half;
    let j = i % half;
    let position = pu(ROPE_FIRST) + row % pu(ROPE_SEQ);
    let t = position * half + j;
    let c = table[t];
    let s = pf(ROPE_SIGN) * table[pu(ROPE_POSITIONS) * half + t];
    let at = pu(ROPE_X_OFFSET) + row * 2u * half + j;
    let x1 = x[at];
    let x2 = x[at + half];
    let o = row * 2u * half + j;
    out[o] = x1 * c - x2 * s;
    out[o + half] = x2 * c + x1 * s;
}
