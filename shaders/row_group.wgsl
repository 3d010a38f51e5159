// The lanes that run the rows of a row kernel's `*_rows` entries (softmax.wgsl, norm.wgsl): a
// workgroup per row, or a subgroup per row (no workgroup memory and no barrier), and sums over
// the lanes to match. A module calls one of the two functions below (`RowLanes` in
// src/kernel/mod.rs splices which) and runs its row body in the loop
//
//     for (var g = row_group(..); g.row < g.end; g.row = g.row + g.step) { .. }
//
// A workgroup's loop runs once. A workgroup of subgroups takes `size / 8` rows, the rows of
// 8-lane subgroups, whatever the width of its subgroups: the host cannot know that width, since
// a driver may pick it per shader (llvmpipe runs some shaders 4 lanes wide and others 8 on one
// machine), so each subgroup steps through the workgroup's rows, `size / width` apart.

struct RowGroup {
    // The row this group of lanes runs now.
    row: u32,
    // This invocation's place among the row's lanes, and how many lanes there are.
    lane: u32,
    lanes: u32,
    // The rows this group runs next are `row + step`, ..., below `end`.
    step: u32,
    end: u32,
}

// A workgroup of `size` per row, for the first `rows` rows.
fn workgroup_row(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, size: u32, rows: u32) -> RowGroup {
    let row = workgroup_index(wid, nwg);
    return RowGroup(row, lid, size, 1u, min(row + 1u, rows));
}

// SUBGROUP SECTION BEGIN: kept only where the device has subgroups of a fixed width.
// A subgroup per row, `size / 8` rows per workgroup (the subgroups of a one-dimensional
// workgroup hold consecutive invocations, as on every adapter wgrad knows).
fn subgroup_row(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, size: u32, rows: u32) -> RowGroup {
    let width = subgroupAdd(1u);
    let first = workgroup_index(wid, nwg) * (size / 8u);
    let subgroups = max(size / width, 1u);
    return RowGroup(first + lid / width, lid % width, width, subgroups, min(first + size / 8u, rows));
}
// SUBGROUP SECTION END
