// Running sums (`cumsum`) along the last dim of a contiguous [rows, len] tensor read from
// element `offset` of its buffer (a row of a larger tensor is a view), from the front or, with
// `reverse`, from the end (the backward). Position p of a row is its element p, or len - 1 - p
// when reversed; everything below works on positions, so block totals stay in position order.
// A row is cut in blocks of 1,024 positions (SCAN_BLOCK in src/ops/scan.rs), one workgroup of
// 256 invocations each, 4 neighbouring positions per invocation: no invocation loops over a
// row, whatever its length (Mesa 22.3's llvmpipe ends an invocation after 65,535 iterations).
// A row of one block is one `scan_blocks` launch. Longer rows take three steps:
// `block_totals` writes each block's total to [rows, blocks], the host scans those totals with
// the same kernels, and `scan_blocks` starts each block from the scanned total of the blocks
// before it. Rows of at most 64 (SERIAL_LEN) run one invocation each (`serial_rows`).
// Params: `ScanParams` (src/ops/scan.rs).

@group(0) @binding(1) var<storage, read> src: array<f32>;
// The running sums [rows, len] (`block_totals`: the totals [rows, blocks]).
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
// `scan_blocks`: the running sums of the block totals, [rows, blocks].
@group(0) @binding(3) var<storage, read> scanned_totals: array<f32>;

var<workgroup> partial: array<f32, 256>;
var<workgroup> block_sum: f32;

// Element of row `row` at position `p`, relative to the row block [rows, len].
fn element(row: u32, p: u32) -> u32 {
    let len = pu(SCAN_LEN);
    return row * len + select(p, len - 1u - p, pu(SCAN_REVERSE) == 1u);
}

// The source at position `p` of row `row`, 0 past the row's end.
fn load(row: u32, p: u32) -> f32 {
    if (p >= pu(SCAN_LEN)) {
        return 0.0;
    }
    return src[pu(SCAN_OFFSET) + element(row, p)];
}

fn store(row: u32, p: u32, v: f32) {
    if (p < pu(SCAN_LEN)) {
        dst[element(row, p)] = v;
    }
}

// The sum of the `v`s of the invocations before `lid` in the workgroup; `block_sum` holds all
// 256's total after it returns. One invocation adds them up in order: two barriers, where a
// tree would take sixteen (each a switch of every SIMD group on software adapters).
fn workgroup_prefix(lid: u32, v: f32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    if (lid == 0u) {
        var run = 0.0;
        for (var i = 0u; i < rolled(256u); i = i + 1u) {
            let next = partial[i];
            partial[i] = run;
            run = run + next;
        }
        block_sum = run;
    }
    workgroupBarrier();
    return partial[lid];
}

// Workgroup `w`'s block: its row, its index in the row, and the first of the 4 positions of
// invocation `lid`.
struct Block {
    row: u32,
    index: u32,
    first: u32,
}

fn block_of(w: u32, lid: u32) -> Block {
    let blocks = pu(SCAN_BLOCKS);
    let row = w / blocks;
    let index = w - row * blocks;
    return Block(row, index, index * 1024u + lid * 4u);
}

// Each block's total, at [row, block] of dst.
@compute @workgroup_size(256)
fn block_totals(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let w = workgroup_index(wid, nwg);
    if (w >= pu(SCAN_ROWS) * pu(SCAN_BLOCKS)) {
        return;
    }
    let b = block_of(w, lid);
    let four = load(b.row, b.first) + load(b.row, b.first + 1u) + load(b.row, b.first + 2u)
        + load(b.row, b.first + 3u);
    workgroup_prefix(lid, four);
    if (lid == 0u) {
        dst[w] = block_sum;
    }
}

// The running sums of each block, from the scanned total of the blocks before it.
@compute @workgroup_size(256)
fn scan_blocks(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let w = workgroup_index(wid, nwg);
    if (w >= pu(SCAN_ROWS) * pu(SCAN_BLOCKS)) {
        return;
    }
    let k = block_of(w, lid);
    let a = load(k.row, k.first);
    let b = load(k.row, k.first + 1u);
    let c = load(k.row, k.first + 2u);
    let d = load(k.row, k.first + 3u);
    var carry = 0.0;
    if (k.index > 0u) {
        carry = scanned_totals[w - 1u];
    }
    let start = carry + workgroup_prefix(lid, a + b + c + d);
    store(k.row, k.first, start + a);
    store(k.row, k.first + 1u, start + a + b);
    store(k.row, k.first + 2u, start + a + b + c);
    store(k.row, k.first + 3u, start + a + b + c + d);
}

// Short rows: one invocation walks each.
@compute @workgroup_size(256)
fn serial_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 256u + lid;
    if (row >= pu(SCAN_ROWS)) {
        return;
    }
    var run = 0.0;
    for (var p = 0u; p < pu(SCAN_LEN); p = p + 1u) {
        run = run + load(row, p);
        store(row, p, run);
    }
}
