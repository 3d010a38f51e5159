// Fills a contiguous f32 tensor with start + step * i (zeros, ones, full, arange).

@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;

// Params: `FillParams` (src/ops/copy.rs). Each invocation fills the four-element groups
// `contiguous_item(.., j, ..)` for j < 16 and reads its params once (one element per invocation
// made a fill 3x slower than an add on CPU adapters: their parameter reads are per lane). The
// last group may be partial; the binding always holds it whole (buffers are sized in 16-byte
// steps).
@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n = pu(FILL_N);
    let start = pf(FILL_START);
    let step = pf(FILL_STEP);
    let per_group = CONTIGUOUS_PER_GROUP / 4u;
    for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, per_group);
        let e = 4u * i;
        if (e >= n) {
            break;
        }
        let value = start + step * vec4<f32>(f32(e), f32(e + 1u), f32(e + 2u), f32(e + 3u));
        if (e + 4u <= n) {
            dst[i] = value;
        } else {
            // The last group's 1 to 3 elements, each at a constant index: a loop picking
            // them by a variable one compiled 13 ms slower on lavapipe 25.
            dst[i].x = value.x;
            if (e + 1u < n) {
                dst[i].y = value.y;
            }
            if (e + 2u < n) {
                dst[i].z = value.z;
            }
        }
    }
}
