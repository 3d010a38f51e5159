// Batched matrix multiply out[b] = A[b] x B[b], with A and B read through strides (so a
// transposed view needs no copy) and out contiguous [batch, M, N].
// params: 0 M, 1 N, 2 K, 3 batch, 4 A offset, 5 A batch stride, 6 A row stride,
//         7 A col stride, 8 B offset, 9 B batch stride, 10 B row stride, 11 B col stride,
//         12 column tiles, 13 row tiles
//
// Two kernels: `register_tiled` keeps an 8x4 block of out in registers and uses no workgroup
// memory or barriers (software adapters run barriers as coroutine switches, so this wins
// there); `shared_tiled` stages 64x16 panels of A and B in workgroup memory (what GPUs want).

@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

struct Tile {
    batch: u32,
    row0: u32,
    col0: u32,
}

// Which batch and which tile of `tile_rows` x `tile_cols` outputs this workgroup computes.
fn tile_of(wid: vec3<u32>, nwg: vec3<u32>, tile_rows: u32, tile_cols: u32) -> Tile {
    let w = workgroup_index(wid, nwg);
    let per_batch = pu(12u) * pu(13u);
    let in_batch = w % per_batch;
    return Tile(w / per_batch, (in_batch / pu(12u)) * tile_rows, (in_batch % pu(12u)) * tile_cols);
}

fn store_row(base: u32, row: u32, col: u32, v: vec4<f32>) {
    let m = pu(0u);
    let n = pu(1u);
    if (row >= m) {
        return;
    }
    let o = base + row * n + col;
    if (col < n) { out[o] = v.x; }
    if (col + 1u < n) { out[o + 1u] = v.y; }
    if (col + 2u < n) { out[o + 2u] = v.z; }
    if (col + 3u < n) { out[o + 3u] = v.w; }
}

// 8 rows x 256 columns per workgroup: every invocation shares the same 8 rows, so the A loads
// are uniform across the workgroup (one scalar load, broadcast, on SIMD-on-CPU adapters), and
// invocation `lid` owns columns col0 + lid + 64 j, so neighbouring invocations read
// neighbouring B elements. 32 accumulators per invocation; no workgroup memory, no barriers.
@compute @workgroup_size(64)
fn register_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let t = tile_of(wid, nwg, 8u, 256u);
    if (t.batch >= pu(3u)) {
        return;
    }
    let m = pu(0u);
    let n = pu(1u);
    let k_len = pu(2u);
    // Rows and columns past the edge read a clamped (valid) element and are not stored.
    let a_base = pu(4u) + t.batch * pu(5u);
    let a_rs = pu(6u);
    let a_cs = pu(7u);
    var a_row: array<u32, 8>;
    for (var i = 0u; i < 8u; i = i + 1u) {
        a_row[i] = a_base + min(t.row0 + i, m - 1u) * a_rs;
    }
    let b_base = pu(8u) + t.batch * pu(9u);
    let b_rs = pu(10u);
    let b_cs = pu(11u);
    let col = t.col0 + lid;
    let b0 = b_base + min(col, n - 1u) * b_cs;
    let b1 = b_base + min(col + 64u, n - 1u) * b_cs;
    let b2 = b_base + min(col + 128u, n - 1u) * b_cs;
    let b3 = b_base + min(col + 192u, n - 1u) * b_cs;
    var acc: array<vec4<f32>, 8>;
    for (var k = 0u; k < k_len; k = k + 1u) {
        let kb = k * b_rs;
        let bv = vec4<f32>(b[b0 + kb], b[b1 + kb], b[b2 + kb], b[b3 + kb]);
        let ka = k * a_cs;
        acc[0] = fma(vec4<f32>(a[a_row[0] + ka]), bv, acc[0]);
        acc[1] = fma(vec4<f32>(a[a_row[1] + ka]), bv, acc[1]);
        acc[2] = fma(vec4<f32>(a[a_row[2] + ka]), bv, acc[2]);
        acc[3] = fma(vec4<f32>(a[a_row[3] + ka]), bv, acc[3]);
        acc[4] = fma(vec4<f32>(a[a_row[4] + ka]), bv, acc[4]);
        acc[5] = fma(vec4<f32>(a[a_row[5] + ka]), bv, acc[5]);
        acc[6] = fma(vec4<f32>(a[a_row[6] + ka]), bv, acc[6]);
        acc[7] = fma(vec4<f32>(a[a_row[7] + ka]), bv, acc[7]);
    }
    let base = t.batch * m * n;
    for (var i = 0u; i < 8u; i = i + 1u) {
        let row = t.row0 + i;
        if (row < m) {
            let o = base + row * n;
            let v = acc[i];
            if (col < n) { out[o + col] = v.x; }
            if (col + 64u < n) { out[o + col + 64u] = v.y; }
            if (col + 128u < n) { out[o + col + 128u] = v.z; }
            if (col + 192u < n) { out[o + col + 192u] = v.w; }
        }
    }
}

const TILE: u32 = 64u;
const TILE_K: u32 = 16u;
var<workgroup> a_panel: array<f32, 1024>; // [TILE_K][TILE] of A, k-major
var<workgroup> b_panel: array<f32, 1024>; // [TILE_K][TILE] of B, k-major

@compute @workgroup_size(256)
fn shared_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let t = tile_of(wid, nwg, TILE, TILE);
    // Uniform across the workgroup, so the early return cannot split a barrier.
    if (t.batch >= pu(3u)) {
        return;
    }
    let m = pu(0u);
    let n = pu(1u);
    let k_len = pu(2u);
    let a_base = pu(4u) + t.batch * pu(5u);
    let b_base = pu(8u) + t.batch * pu(9u);
    let tr = (lid / 16u) * 4u;
    let tc = (lid % 16u) * 4u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < k_len; k0 = k0 + TILE_K) {
        // Each of the 256 invocations loads 4 elements of each panel; out-of-range ones are 0.
        for (var j = 0u; j < 4u; j = j + 1u) {
            let e = lid * 4u + j;
            let kk = e / TILE;
            let rc = e % TILE;
            let k = k0 + kk;
            let r = t.row0 + rc;
            let c = t.col0 + rc;
            var av = 0.0;
            if (k < k_len && r < m) {
                av = a[a_base + r * pu(6u) + k * pu(7u)];
            }
            var bv = 0.0;
            if (k < k_len && c < n) {
                bv = b[b_base + k * pu(10u) + c * pu(11u)];
            }
            a_panel[e] = av;
            b_panel[e] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TILE_K; kk = kk + 1u) {
            let bv = vec4<f32>(b_panel[kk * TILE + tc], b_panel[kk * TILE + tc + 1u],
                               b_panel[kk * TILE + tc + 2u], b_panel[kk * TILE + tc + 3u]);
            acc0 = fma(vec4<f32>(a_panel[kk * TILE + tr]), bv, acc0);
            acc1 = fma(vec4<f32>(a_panel[kk * TILE + tr + 1u]), bv, acc1);
            acc2 = fma(vec4<f32>(a_panel[kk * TILE + tr + 2u]), bv, acc2);
            acc3 = fma(vec4<f32>(a_panel[kk * TILE + tr + 3u]), bv, acc3);
        }
        workgroupBarrier();
    }
    let base = t.batch * m * n;
    store_row(base, t.row0 + tr, t.col0 + tc, acc0);
    store_row(base, t.row0 + tr + 1u, t.col0 + tc, acc1);
    store_row(base, t.row0 + tr + 2u, t.col0 + tc, acc2);
    store_row(base, t.row0 + tr + 3u, t.col0 + tc, acc3);
}
