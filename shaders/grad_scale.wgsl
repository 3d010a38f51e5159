// Loss scaling (`optim::GradScaler`): a grad multiplied in place by the inverse scale, and a
// flag set when any of its elements is inf or NaN. One launch per grad, all setting the same
// flag word. (`GradScaler::step` reads the flag back, as torch's does, so it runs eagerly.)

@group(0) @binding(1) var<storage, read_write> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> found_inf: array<atomic<u32>>;

// Params: `UnscaleParams` (src/optim/scaler.rs). Each invocation visits its items of the
// workgroup's span; the flag is written once per invocation that saw a non-finite value.
fn unscale_part(workgroup: u32, lid: u32) {
    let n = pu(UNSCALE_N);
    let inv_scale = pf(UNSCALE_INV_SCALE);
    var bad = false;
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item_at(workgroup, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        let at = pu(UNSCALE_OFFSET) + i;
        let g = grad[at];
        // Tested on the bits: inf and NaN have every exponent bit set.
        bad = bad || (bitcast<u32>(g) & 0x7f800000u) == 0x7f800000u;
        grad[at] = g * inv_scale;
    }
    if (bad) {
        atomicMax(&found_inf[0], 1u);
    }
}

@compute @workgroup_size(256)
fn unscale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    unscale_part(workgroup_index(wid, nwg), lid);
}
