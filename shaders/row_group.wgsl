// The lanes that run one row of a row kernel's `*_rows` entries (softmax.wgsl, norm.wgsl):
// the row, this invocation's place among its lanes, and how many lanes there are. A module
// calls one of the two functions below (`RowLanes` in src/kernel/mod.rs splices which): a
// workgroup per row, or a subgroup per row (`size` / width rows per workgroup, no workgroup
// memory and no barrier), and sums over the lanes to match.

struct RowGroup {
    row: u32,
    lane: u32,
    lanes: u32,
}

// A workgroup of `size` per row.
fn workgroup_row(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, size: u32) -> RowGroup {
    return RowGroup(workgroup_index(wid, nwg), lid, size);
}

// SUBGROUP SECTION BEGIN: kept only where the device has subgroups of a fixed width.
// A subgroup per row (the subgroups of a one-dimensional workgroup hold consecutive
// invocations, as on every adapter wgrad knows).
fn subgroup_row(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, size: u32) -> RowGroup {
    let width = subgroupAdd(1u);
    return RowGroup(workgroup_index(wid, nwg) * (size / width) + lid / width, lid % width, width);
}
// SUBGROUP SECTION END
