// Fills a contiguous f32 tensor with start + step * i (zeros, ones, full, arange).

@group(0) @binding(1) var<storage, read_write> dst: array<f32>;

// Params: `FillParams` (src/ops/copy.rs).
@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(FILL_N)) {
        return;
    }
    dst[i] = pf(FILL_START) + pf(FILL_STEP) * f32(i);
}
