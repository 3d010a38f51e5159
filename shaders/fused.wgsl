// The entry points of the kernels a captured step generates (src/capture/codegen.rs). The codegen
// writes the bindings (`in0`.., `out0`..) and the element function (`element`, running the
// fused ops at one element) above one of these sections, and fills in its LOADS (the
// `let a{k} = ..;` lines), ARGS and STORES. Each section is a template, not a module.

// VEC4 ENTRY BEGIN
// Four elements at a time, where every load is a whole aligned vec4: the contiguous kernels'
// loop (shaders/common.wgsl), over vec4s.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n = pu(0u);
    let per_group = CONTIGUOUS_PER_GROUP / 4u;
    for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, per_group);
        if (i >= n / 4u) {
            break;
        }
        LOADS
        let rx = element(ARGS_X);
        let ry = element(ARGS_Y);
        let rz = element(ARGS_Z);
        let rw = element(ARGS_W);
        STORES
    }
}
// VEC4 ENTRY END

// ELEMENT ENTRY BEGIN
// One element at a time: the contiguous kernels' loop over elements.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n = pu(0u);
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        LOADS
        let r = element(ARGS);
        STORES
    }
}
// ELEMENT ENTRY END

// MERGED ENTRY BEGIN
// Merged launches: each member's workgroups follow the previous member's, and PARTS sends a
// workgroup to its member's part function with its index within that member.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = workgroup_index(wid, nwg);
    PARTS
}
// MERGED ENTRY END
