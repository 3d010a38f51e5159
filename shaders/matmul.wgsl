// Batched matrix multiply out[b] = A[b] x B[b], with A and B read through strides (so a
// transposed view needs no copy) and out contiguous [batch, M, N].
// Params: `MatmulParams` (src/ops/matmul.rs).
//
// Five kernels: `register_tiled` keeps an 8x8 block of out per invocation in registers and
// uses no workgroup memory or barriers (software adapters run barriers as coroutine switches,
// so this wins there; GPUs run it for products with a side under 64); `register_tiled_tall`
// keeps 32x4 with the A loads shared by 8-wide subgroups (software adapters with subgroups);
// `small_tiled` keeps 8x8 for small products on software adapters, in one module for every
// layout; `block_tiled` and `block_tiled_64` stage panels of 128 or 64 rows of A and columns
// of B in workgroup memory and keep 8x8 per invocation (what GPUs want).
//
// Buffers are bound as arrays of vec4 so that the register kernels can load four elements at a
// time where the layout allows: software adapters pay per load, not per element. The host
// picks how each operand is read by splicing A_MODE and B_MODE:
//   A_MODE k: A[r][k..k+4] is one aligned vec4 (row stride and offsets multiples of 4, col
//             stride 1); m: A[r..r+4][k] is one aligned vec4 (col stride and offsets multiples
//             of 4, row stride 1, M a multiple of 8, or of 4 for register_tiled_tall, which
//             clamps a lane's group of 4 rows to the last whole one); any: one element at a
//             time.
//   B_MODE n: B[k][c..c+4] is one aligned vec4 (N a multiple of 4); k: B[k..k+4][c] is one
//             aligned vec4; any: one element at a time.
// B_SOURCE (matrix, image or image_t) says what every kernel but `small_tiled` multiplies by:
// B as above, a 2-d convolution's column matrix read from the input images (see
// b_columns_image and load_b_panel_image), or its transpose (a weight grad's; image_t).
// It also splices K_TAIL (K may not be a multiple of 4: the last step of 4 along k is partial,
// its A and B elements past K masked to 0), so that the masks are compiled out where no
// product needs them. Whether an output group of 4 is one vec4 store is decided at run time
// (`store_row_at`): its one per-element store site costs no more to compile than a check,
// where a module per alignment cost a model's first step 0.4 s each.
//
// Where the device has 8-wide subgroups (llvmpipe, where a subgroup is one SIMD group), the
// module keeps the SUBGROUP SECTIONs: `register_tiled_tall` and its helpers, whose 8 lanes
// load the A blocks they share once and assemble them with subgroupBroadcast, and the block
// kernels' entries, whose 8 lanes share their A panel reads the same way. Elsewhere the
// sections are cut out (they need the device's subgroup feature), the block kernels' entries
// replaced by ones whose every invocation reads its own A.

// A and B are bound as words and read as f32 through a_at/a_quad and b_at/b_quad: F32
// elements four to a vec4, F16 or BF16 ones eight (A_DTYPE and B_DTYPE are spliced: 0 F32,
// 2 F16, 3 BF16; see sixteen_bit.wgsl). Offsets and strides count elements
// whatever the dtype, and products accumulate in f32. `out` is F32 (OUT_WORDS vec4<f32>), or
// 16-bit where N is a multiple of 4 (OUT_WORDS vec4<u32>, and the 16-BIT STORES below take
// the place of the EPILOGUE SECTION): each store is then a whole aligned group of four.
@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> out: array<OUT_WORDS>;

const A_DTYPE: u32 = A_DTYPE_CODEu;
const B_DTYPE: u32 = B_DTYPE_CODEu;

// F16 OPERAND a BEGIN
// Element i of A.
fn a_at(i: u32) -> f32 {
    if (A_DTYPE == 0u) {
        return bitcast<f32>(a[i / 4u][i % 4u]);
    }
    return half_to_f32(half_of(a[i / 8u][(i / 2u) % 4u], i), A_DTYPE);
}

// Elements 4q .. 4q + 4 of A.
fn a_quad(q: u32) -> vec4<f32> {
    if (A_DTYPE == 0u) {
        return bitcast<vec4<f32>>(a[q]);
    }
    return halves_to_f32x4(a[q / 2u], q, A_DTYPE);
}
// F16 OPERAND a END

// F16 OPERAND b BEGIN
// Element i of B.
fn b_at(i: u32) -> f32 {
    if (B_DTYPE == 0u) {
        return bitcast<f32>(b[i / 4u][i % 4u]);
    }
    return half_to_f32(half_of(b[i / 8u][(i / 2u) % 4u], i), B_DTYPE);
}

// Elements 4q .. 4q + 4 of B.
fn b_quad(q: u32) -> vec4<f32> {
    if (B_DTYPE == 0u) {
        return bitcast<vec4<f32>>(b[q]);
    }
    return halves_to_f32x4(b[q / 2u], q, B_DTYPE);
}
// F16 OPERAND b END

struct Tile {
    batch: u32,
    row0: u32,
    col0: u32,
}

// Which batch and which tile of `tile_rows` x `tile_cols` outputs this workgroup computes.
fn tile_of(wid: vec3<u32>, nwg: vec3<u32>, tile_rows: u32, tile_cols: u32) -> Tile {
    let w = workgroup_index(wid, nwg);
    let per_batch = pu(MATMUL_COL_TILES) * pu(MATMUL_ROW_TILES);
    let in_batch = w % per_batch;
    return Tile(w / per_batch, (in_batch / pu(MATMUL_COL_TILES)) * tile_rows, (in_batch % pu(MATMUL_COL_TILES)) * tile_cols);
}

// Writes out[row][col..col+4] at element offset `o`, skipping rows and columns past the edge.
// A whole group starting on a vec4 boundary (every group where N is a multiple of 4, as
// `col` is) is one vec4 store; the rest of an odd N's groups go element by element (each
// group has one owner, so neither path writes another invocation's elements).
fn store_row_at(o: u32, row: u32, col: u32, v: vec4<f32>) {
    let n = pu(MATMUL_N);
    if (row >= pu(MATMUL_M) || col >= n) {
        return;
    }
    if (o % 4u == 0u && col + 4u <= n) {
        store4(o, v);
        return;
    }
    for (var j = 0u; j < min(4u, n - col); j = j + 1u) {
        store1(o + j, v[j]);
    }
}

// EPILOGUE SECTION BEGIN
// How an output value is stored: out[o..o+4] (o a multiple of 4) and out[o]. A captured
// step's fuser replaces this section with stores that first run the elementwise ops that
// consume the product (a bias add, an activation, a residual add), so that they cost no
// pass of their own (src/capture/passes/epilogue.rs).
fn store4(o: u32, v: vec4<f32>) {
    out[o / 4u] = v;
}

fn store1(o: u32, v: f32) {
    out[o / 4u][o % 4u] = v;
}
// EPILOGUE SECTION END

// 16-BIT STORES BEGIN
// Stores of a 16-bit `out` (OUT_DTYPE 2 F16, 3 BF16): four elements, two words, rounded once.
// N is a multiple of 4 (the host's rule), so every group is whole and aligned: no two
// invocations write one word.
fn store4(o: u32, v: vec4<f32>) {
    let w = o / 2u;
    out[w / 4u][w % 4u] = pack_halves(v.x, v.y, OUT_DTYPE_CODEu);
    out[w / 4u][w % 4u + 1u] = pack_halves(v.z, v.w, OUT_DTYPE_CODEu);
}

fn store1(o: u32, v: f32) {
}
// 16-BIT STORES END

// A 4x4 block of A as a matrix whose column kk holds rows `rows` of A at k + kk.
// `at` is the element offset of A[rows.x][k]; `rs`, `cs` are A's strides.
fn a_block_k(at: u32, rows: vec4<u32>, rs: u32, cs: u32) -> mat4x4<f32> {
    let base = at - rows.x * rs;
    return transpose(mat4x4<f32>(a_quad(at / 4u), a_quad((base + rows.y * rs) / 4u),
                                 a_quad((base + rows.z * rs) / 4u), a_quad((base + rows.w * rs) / 4u)));
}

fn a_block_m(at: u32, rows: vec4<u32>, rs: u32, cs: u32) -> mat4x4<f32> {
    return mat4x4<f32>(a_quad(at / 4u), a_quad((at + cs) / 4u), a_quad((at + 2u * cs) / 4u), a_quad((at + 3u * cs) / 4u));
}

fn a_block_any(at: u32, rows: vec4<u32>, rs: u32, cs: u32) -> mat4x4<f32> {
    let base = at - rows.x * rs;
    var block: mat4x4<f32>;
    for (var kk = 0u; kk < 4u; kk = kk + 1u) {
        let o = base + kk * cs;
        block[kk] = vec4<f32>(a_at(o + rows.x * rs), a_at(o + rows.y * rs), a_at(o + rows.z * rs), a_at(o + rows.w * rs));
    }
    return block;
}

// A 4x4 block of B as a matrix whose column j holds B[k..k+4][cols[j]].
// `at` is the element offset of B[k][cols.x]; `rs`, `cs` are B's strides.
fn b_block_n(at: u32, cols: vec4<u32>, rs: u32, cs: u32) -> mat4x4<f32> {
    return transpose(mat4x4<f32>(b_quad(at / 4u), b_quad((at + rs) / 4u), b_quad((at + 2u * rs) / 4u), b_quad((at + 3u * rs) / 4u)));
}

fn b_block_k(at: u32, cols: vec4<u32>, rs: u32, cs: u32) -> mat4x4<f32> {
    let base = at - cols.x * cs;
    return mat4x4<f32>(b_quad(at / 4u), b_quad((base + cols.y * cs) / 4u), b_quad((base + cols.z * cs) / 4u), b_quad((base + cols.w * cs) / 4u));
}

fn b_block_any(at: u32, cols: vec4<u32>, rs: u32, cs: u32) -> mat4x4<f32> {
    let base = at - cols.x * cs;
    var block: mat4x4<f32>;
    for (var j = 0u; j < 4u; j = j + 1u) {
        let o = base + cols[j] * cs;
        block[j] = vec4<f32>(b_at(o), b_at(o + rs), b_at(o + 2u * rs), b_at(o + 3u * rs));
    }
    return block;
}

// The two 4x4 blocks of A (rows lo and rows hi) for one step of 4 along k.
struct APair {
    lo: mat4x4<f32>,
    hi: mat4x4<f32>,
}

fn a_pair(lo_at: u32, hi_at: u32, rows_lo: vec4<u32>, rows_hi: vec4<u32>, rs: u32, cs: u32) -> APair {
    return APair(a_block_A_MODE(lo_at, rows_lo, rs, cs), a_block_A_MODE(hi_at, rows_hi, rs, cs));
}

// What every kernel but small_tiled multiplies by, spliced as B_SOURCE: `matrix`, B read
// through its strides in B_MODE; or `image`, the column matrix of a 2-d convolution read
// straight from the input images (an implicit GEMM: no im2col pass writes and reads it). There
// B[k][n] is input element (image, channel c, y, x) for k = (ty, tx, c), the weight's taps laid
// out channels innermost, and n = (image, oy, ox); y = oy stride_h + ty dilation_h - padding_h,
// x likewise, and 0 outside the image. The register kernels step the channel and tap of each k
// like an odometer (no divisions along k); k is padded to whole 4s with zero weights and zero
// rows. The product lands in NCHW order, each image's pixels a multiple of 4 (a group of 4
// output columns stays in one image).

// Where an invocation's 4 columns of B are read: `at`, the offset of B[0][cols.x] (matrix);
// each column's image plane 0 offset and window corner (image).
struct BColumns {
    at: u32,
    cols: vec4<u32>,
    image_at: vec4<i32>,
    y0: vec4<i32>,
    x0: vec4<i32>,
}

// The image source's channel and tap at the current k (the odometer); for the transposed
// image source (`image_t`), the image in the group (`c_at`, its offset), the output pixel
// (`oy`, `ox`) and where its window starts (`dy`, `dx`: oy stride_h, ox stride_w).
struct BStep {
    c: u32,
    c_at: i32,
    tx: u32,
    dy: i32,
    dx: i32,
    oy: u32,
    ox: u32,
}

// Where an invocation stores output row r: `at + r * row_stride`.
struct OutColumn {
    at: u32,
    row_stride: u32,
}

fn b_columns_matrix(b_base: u32, cols: vec4<u32>) -> BColumns {
    var c: BColumns;
    c.at = b_base + cols.x * pu(MATMUL_B_COL_STRIDE);
    c.cols = cols;
    return c;
}

fn b_block_matrix(c: BColumns, step: ptr<function, BStep>, k: u32) -> mat4x4<f32> {
    let rs = pu(MATMUL_B_ROW_STRIDE);
    return b_block_B_MODE(c.at + k * rs, c.cols, rs, pu(MATMUL_B_COL_STRIDE));
}

fn out_column_matrix(batch: u32, col: u32) -> OutColumn {
    let n = pu(MATMUL_N);
    return OutColumn(batch * pu(MATMUL_M) * n + col, n);
}

fn b_columns_image(b_base: u32, cols: vec4<u32>) -> BColumns {
    let pixels = pu(MATMUL_CONV_PIXELS);
    let ow = pu(MATMUL_CONV_OUT_W);
    let image = cols / pixels;
    let p = cols - image * pixels;
    let oy = p / ow;
    var c: BColumns;
    c.image_at = vec4<i32>(b_base + image * pu(MATMUL_CONV_C_IN) * pu(MATMUL_CONV_HEIGHT) * pu(MATMUL_CONV_WIDTH));
    c.y0 = vec4<i32>(oy * pu(MATMUL_CONV_STRIDE_H)) - i32(pu(MATMUL_CONV_PADDING_H));
    c.x0 = vec4<i32>((p - oy * ow) * pu(MATMUL_CONV_STRIDE_W)) - i32(pu(MATMUL_CONV_PADDING_W));
    return c;
}

// Row k of the image columns at the invocation's 4 columns (0 past the last k, which pads k
// to whole 4s), then the odometer advanced by one along k: the next channel; past the last,
// the next tap along x; past the last tap of a row, the next row of taps.
fn image_row(c: BColumns, step: ptr<function, BStep>, live: bool) -> vec4<f32> {
    let h = pu(MATMUL_CONV_HEIGHT);
    let w = pu(MATMUL_CONV_WIDTH);
    let s = *step;
    let y = c.y0 + s.dy;
    let x = c.x0 + s.dx;
    let inside = vec4<u32>(y) < vec4<u32>(h) & vec4<u32>(x) < vec4<u32>(w) & vec4<bool>(live);
    let at = vec4<u32>(select(c.image_at, c.image_at + s.c_at + y * i32(w) + x, inside));
    let v = vec4<f32>(b_at(at.x), b_at(at.y), b_at(at.z), b_at(at.w));
    let next_tap = s.c + 1u == pu(MATMUL_CONV_C_IN);
    let next_row = next_tap && s.tx + 1u == pu(MATMUL_CONV_KERNEL_W);
    var n: BStep;
    n.c = select(s.c + 1u, 0u, next_tap);
    n.c_at = select(s.c_at + i32(h * w), 0, next_tap);
    n.tx = select(s.tx, select(s.tx + 1u, 0u, next_row), next_tap);
    n.dx = select(s.dx, select(s.dx + i32(pu(MATMUL_CONV_DILATION_W)), 0, next_row), next_tap);
    n.dy = select(s.dy, s.dy + i32(pu(MATMUL_CONV_DILATION_H)), next_row);
    *step = n;
    return select(vec4<f32>(0.0), v, inside);
}

fn b_block_image(c: BColumns, step: ptr<function, BStep>, k: u32) -> mat4x4<f32> {
    let k_len = pu(MATMUL_CONV_K);
    let r0 = image_row(c, step, k < k_len);
    let r1 = image_row(c, step, k + 1u < k_len);
    let r2 = image_row(c, step, k + 2u < k_len);
    let r3 = image_row(c, step, k + 3u < k_len);
    return transpose(mat4x4<f32>(r0, r1, r2, r3));
}

fn out_column_image(batch: u32, col: u32) -> OutColumn {
    let pixels = pu(MATMUL_CONV_PIXELS);
    let image = col / pixels;
    return OutColumn(image * pu(MATMUL_M) * pixels + (col - image * pixels), pixels);
}

// `image_t`: the transposed column matrix, a convolution's weight grad out_grad x cols^T read
// from the images. B[k][n] is input element (image j of the batch's group, channel c, y, x) for
// k = (j, oy, ox) an output pixel of the group's images (k runs over the group's pixels, a
// multiple of 4) and n = (c, ty, tx) a weight of one output channel, in the weight's own
// layout; y = oy stride_h + ty dilation_h - padding_h, x likewise, 0 outside the image. Each
// invocation's 4 columns are placed once; the odometer steps the pixel along k (no division).
fn b_columns_image_t(b_base: u32, cols: vec4<u32>) -> BColumns {
    let h = pu(MATMUL_CONV_HEIGHT);
    let w = pu(MATMUL_CONV_WIDTH);
    let kernel_w = pu(MATMUL_CONV_KERNEL_W);
    let taps = pu(MATMUL_N) / pu(MATMUL_CONV_C_IN);
    let c = cols / taps;
    let tap = cols - c * taps;
    let ty = tap / kernel_w;
    var columns: BColumns;
    columns.cols = cols;
    columns.image_at = vec4<i32>(b_base + c * h * w);
    columns.y0 = vec4<i32>(ty * pu(MATMUL_CONV_DILATION_H)) - i32(pu(MATMUL_CONV_PADDING_H));
    columns.x0 = vec4<i32>((tap - ty * kernel_w) * pu(MATMUL_CONV_DILATION_W)) - i32(pu(MATMUL_CONV_PADDING_W));
    return columns;
}

// Row k (an output pixel) of the transposed image columns at the invocation's 4 columns (0
// past the last column and where `live` is false), then the odometer advanced to the next
// pixel: along the row, then the next row, then the group's next image.
fn image_t_row(c: BColumns, step: ptr<function, BStep>, live: bool) -> vec4<f32> {
    let h = pu(MATMUL_CONV_HEIGHT);
    let w = pu(MATMUL_CONV_WIDTH);
    let ow = pu(MATMUL_CONV_OUT_W);
    let s = *step;
    let y = c.y0 + s.dy;
    let x = c.x0 + s.dx;
    let inside = vec4<u32>(y) < vec4<u32>(h) & vec4<u32>(x) < vec4<u32>(w)
        & c.cols < vec4<u32>(pu(MATMUL_N)) & vec4<bool>(live);
    let at = vec4<u32>(select(c.image_at, c.image_at + s.c_at + y * i32(w) + x, inside));
    let v = vec4<f32>(b_at(at.x), b_at(at.y), b_at(at.z), b_at(at.w));
    let next_row = s.ox + 1u == ow;
    let next_image = next_row && (s.oy + 1u) * ow == pu(MATMUL_CONV_PIXELS);
    var n = s;
    n.ox = select(s.ox + 1u, 0u, next_row);
    n.dx = select(s.dx + i32(pu(MATMUL_CONV_STRIDE_W)), 0, next_row);
    n.oy = select(s.oy, select(s.oy + 1u, 0u, next_image), next_row);
    n.dy = select(s.dy, select(s.dy + i32(pu(MATMUL_CONV_STRIDE_H)), 0, next_image), next_row);
    n.c_at = select(s.c_at, s.c_at + i32(pu(MATMUL_CONV_C_IN) * h * w), next_image);
    *step = n;
    return select(vec4<f32>(0.0), v, inside);
}

fn b_block_image_t(c: BColumns, step: ptr<function, BStep>, k: u32) -> mat4x4<f32> {
    let k_len = pu(MATMUL_K);
    let r0 = image_t_row(c, step, k < k_len);
    let r1 = image_t_row(c, step, k + 1u < k_len);
    let r2 = image_t_row(c, step, k + 2u < k_len);
    let r3 = image_t_row(c, step, k + 3u < k_len);
    return transpose(mat4x4<f32>(r0, r1, r2, r3));
}

fn out_column_image_t(batch: u32, col: u32) -> OutColumn {
    return out_column_matrix(batch, col);
}

// SUBGROUP SECTION BEGIN: kept only where the device has 8-wide subgroups.

// Lanes 0-3's and lanes 4-7's vectors as the columns of a matrix (lane ids must be constants).
fn broadcast_lo(v: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u),
                       subgroupBroadcast(v, 2u), subgroupBroadcast(v, 3u));
}

fn broadcast_hi(v: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u),
                       subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}

// The two 4x4 A blocks of 8 rows from one vec4 per lane: in k and any modes lane l loaded row
// l at k..k+4; in m mode lane l loaded rows 4 (l / 4) .. +4 at k + l % 4.
fn a_blocks_k(v: vec4<f32>) -> APair {
    return APair(transpose(broadcast_lo(v)), transpose(broadcast_hi(v)));
}

fn a_blocks_m(v: vec4<f32>) -> APair {
    return APair(broadcast_lo(v), broadcast_hi(v));
}

fn a_blocks_any(v: vec4<f32>) -> APair {
    return a_blocks_k(v);
}

// Element offset of the vec4 that lane `lane` loads for rows row0 .. row0 + 8 at step k = 0
// (see a_blocks_*; step k adds k times A's col stride); `a_base` is the batch's A[0][0]. Rows
// past the last are clamped to valid ones, whose results are never stored.
fn a_lane_at_k(a_base: u32, row0: u32, lane: u32) -> u32 {
    return a_base + min(row0 + lane, pu(MATMUL_M) - 1u) * pu(MATMUL_A_ROW_STRIDE);
}

fn a_lane_at_m(a_base: u32, row0: u32, lane: u32) -> u32 {
    return a_base + min(row0 + (lane / 4u) * 4u, pu(MATMUL_M) - 4u) * pu(MATMUL_A_ROW_STRIDE) + (lane % 4u) * pu(MATMUL_A_COL_STRIDE);
}

fn a_lane_at_any(a_base: u32, row0: u32, lane: u32) -> u32 {
    return a_lane_at_k(a_base, row0, lane);
}

// A lane's vec4 of step k with what lies past `k_len` zeroed (K_TAIL's partial last step): in
// k and any modes the lane holds one row at k..k+4; in m mode 4 rows at k + lane % 4.
fn masked_lane_k(v: vec4<f32>, k: u32, k_len: u32, lane: u32) -> vec4<f32> {
    if (!K_TAIL) {
        return v;
    }
    return select(vec4<f32>(0.0), v, k_inside(k, k_len));
}

fn masked_lane_m(v: vec4<f32>, k: u32, k_len: u32, lane: u32) -> vec4<f32> {
    if (!K_TAIL) {
        return v;
    }
    return select(vec4<f32>(0.0), v, k + lane % 4u < k_len);
}

fn masked_lane_any(v: vec4<f32>, k: u32, k_len: u32, lane: u32) -> vec4<f32> {
    return masked_lane_k(v, k, k_len, lane);
}

// The vec4 a lane loads at step k (`at` from a_lane_at_*, `cs` A's col stride): one aligned
// load in k and m modes, four element loads in any mode (still once per subgroup, not per
// invocation).
fn a_lane_load_k(at: u32, k: u32, cs: u32) -> vec4<f32> {
    return a_quad((at + k * cs) / 4u);
}

fn a_lane_load_m(at: u32, k: u32, cs: u32) -> vec4<f32> {
    return a_lane_load_k(at, k, cs);
}

fn a_lane_load_any(at: u32, k: u32, cs: u32) -> vec4<f32> {
    let o = at + k * cs;
    return vec4<f32>(a_at(o), a_at(o + cs), a_at(o + 2u * cs), a_at(o + 3u * cs));
}

// TALL_ROWS (32, or 16 for products of at most 16 rows) rows x 128 columns per workgroup, on
// 8-wide subgroups: each subgroup shares the rows, whose A blocks its 8 lanes load together
// (one vec4 per lane per 8 rows per step of 4 along k), and invocation `lid` owns 4 columns
// from col0 + 4 lid (one 4x4 block of B per step). A software adapter runs each load as a loop
// over the SIMD group's lanes, so loads, not multiply-adds, bound this kernel: per step 32
// rows do 512 multiply-adds per lane for 8 vec4 loads (16 rows do 256 for 6, and ran 15 to
// 25 % slower on 128 rows and more; 64 rows spill more accumulators than they save). The
// second 16 rows are compiled out where TALL_ROWS is 16.
@compute @workgroup_size(32)
fn register_tiled_tall(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let t = tile_of(wid, nwg, TALL_ROWSu, 128u);
    if (t.batch >= pu(MATMUL_BATCHES)) {
        return;
    }
    // Whole subgroups past the last column leave (the others share their A loads).
    if (t.col0 + (lid - lid % 8u) * 4u >= pu(MATMUL_N)) {
        return;
    }
    let k_len = pu(MATMUL_K);
    let a_base = pu(MATMUL_A_OFFSET) + t.batch * pu(MATMUL_A_BATCH_STRIDE);
    let a_cs = pu(MATMUL_A_COL_STRIDE);
    let b_base = pu(MATMUL_B_OFFSET) + t.batch * pu(MATMUL_B_BATCH_STRIDE);
    let col = t.col0 + lid * 4u;
    let cols = cols_from(col);
    let b_cols = b_columns_B_SOURCE(b_base, cols);
    var b_step = BStep();
    let a_0 = a_lane_at_A_MODE(a_base, t.row0, lane);
    let a_8 = a_lane_at_A_MODE(a_base, t.row0 + 8u, lane);
    let a_16 = a_lane_at_A_MODE(a_base, t.row0 + 16u, lane);
    let a_24 = a_lane_at_A_MODE(a_base, t.row0 + 24u, lane);
    var acc0 = mat4x4<f32>(); // rows row0 .. row0 + 4
    var acc1 = mat4x4<f32>();
    var acc2 = mat4x4<f32>();
    var acc3 = mat4x4<f32>();
    var acc4 = mat4x4<f32>();
    var acc5 = mat4x4<f32>();
    var acc6 = mat4x4<f32>();
    var acc7 = mat4x4<f32>();
    for (var k = 0u; k < k_steps(k_len); k = k + 4u) {
        let b_blk = masked_b_block(b_block_B_SOURCE(b_cols, &b_step, k), k, k_len);
        let p0 = a_blocks_A_MODE(masked_lane_A_MODE(a_lane_load_A_MODE(a_0, k, a_cs), k, k_len, lane));
        acc0 = acc0 + p0.lo * b_blk;
        acc1 = acc1 + p0.hi * b_blk;
        let p1 = a_blocks_A_MODE(masked_lane_A_MODE(a_lane_load_A_MODE(a_8, k, a_cs), k, k_len, lane));
        acc2 = acc2 + p1.lo * b_blk;
        acc3 = acc3 + p1.hi * b_blk;
        if (TALL_ROWSu == 32u) {
            let p2 = a_blocks_A_MODE(masked_lane_A_MODE(a_lane_load_A_MODE(a_16, k, a_cs), k, k_len, lane));
            acc4 = acc4 + p2.lo * b_blk;
            acc5 = acc5 + p2.hi * b_blk;
            let p3 = a_blocks_A_MODE(masked_lane_A_MODE(a_lane_load_A_MODE(a_24, k, a_cs), k, k_len, lane));
            acc6 = acc6 + p3.lo * b_blk;
            acc7 = acc7 + p3.hi * b_blk;
        }
    }
    // Transposed, column i of each accumulator is one output row's 4 columns. The rows are
    // stored by one rolled loop that picks its row with selects: an unrolled store per row
    // compiled into twice the code (llvmpipe compiles every store into a loop over lanes).
    let r0 = transpose(acc0);
    let r1 = transpose(acc1);
    let r2 = transpose(acc2);
    let r3 = transpose(acc3);
    let r4 = transpose(acc4);
    let r5 = transpose(acc5);
    let r6 = transpose(acc6);
    let r7 = transpose(acc7);
    let out_col = out_column_B_SOURCE(t.batch, col);
    for (var i = 0u; i < rolled(TALL_ROWSu); i = i + 1u) {
        let blk = i / 4u;
        var c: mat4x4<f32> = r0;
        c = pick(c, r1, blk == 1u);
        c = pick(c, r2, blk == 2u);
        c = pick(c, r3, blk == 3u);
        c = pick(c, r4, blk == 4u);
        c = pick(c, r5, blk == 5u);
        c = pick(c, r6, blk == 6u);
        c = pick(c, r7, blk == 7u);
        let row = t.row0 + i;
        store_row_at(out_col.at + row * out_col.row_stride, row, col, column_of(c, i % 4u));
    }
}

// SUBGROUP SECTION END

// Column `q` of `m`, picked with selects (a dynamic index would keep `m` in memory).
fn column_of(m: mat4x4<f32>, q: u32) -> vec4<f32> {
    var v = m[0];
    v = select(v, m[1], q == 1u);
    v = select(v, m[2], q == 2u);
    return select(v, m[3], q == 3u);
}

// `b` where `take`, else `a`, column by column.
fn pick(a: mat4x4<f32>, b: mat4x4<f32>, take: bool) -> mat4x4<f32> {
    return mat4x4<f32>(select(a[0], b[0], take), select(a[1], b[1], take),
                       select(a[2], b[2], take), select(a[3], b[3], take));
}

// The rows of A (and columns of B) an invocation reads: clamped to the last valid one, so
// edge invocations read valid memory and only their stores are skipped. Vec4 modes keep the
// four together (their extent is a multiple of 4, so an aligned group never straddles it).
fn rows_from(r0: u32) -> vec4<u32> {
    return min(vec4<u32>(r0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(pu(MATMUL_M) - 1u));
}

fn cols_from(c0: u32) -> vec4<u32> {
    let n = pu(MATMUL_N);
    if (B_ALIGNED_COLS) {
        return vec4<u32>(min(c0, n - 4u)) + vec4<u32>(0u, 1u, 2u, 3u);
    }
    return min(vec4<u32>(c0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(n - 1u));
}

// How far the register kernels step along k, 4 at a time: to K, or with K_TAIL past it to the
// next multiple of 4, the last step partial. Its elements past K are masked to 0 (what lies
// there is not the operand's, and may be NaN): one loop, where a tail of single steps after
// it compiled into a second copy of the multiply-adds (40 % of a module's compile time on
// lavapipe 25).
fn k_steps(k_len: u32) -> u32 {
    if (K_TAIL) {
        return (k_len + 3u) / 4u * 4u;
    }
    return k_len;
}

// Which of k .. k + 4 lie before `k_len`.
fn k_inside(k: u32, k_len: u32) -> vec4<bool> {
    return vec4<u32>(k) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(k_len);
}

// A block of A (column kk: 4 rows at k + kk) with the columns past `k_len` zeroed.
fn masked_a_block(blk: mat4x4<f32>, k: u32, k_len: u32) -> mat4x4<f32> {
    if (!K_TAIL) {
        return blk;
    }
    let inside = k_inside(k, k_len);
    return mat4x4<f32>(select(vec4<f32>(0.0), blk[0], inside.x), select(vec4<f32>(0.0), blk[1], inside.y),
                       select(vec4<f32>(0.0), blk[2], inside.z), select(vec4<f32>(0.0), blk[3], inside.w));
}

// A block of B (column j: B[k..k+4][cols[j]]) with the rows past `k_len` zeroed.
fn masked_b_block(blk: mat4x4<f32>, k: u32, k_len: u32) -> mat4x4<f32> {
    if (!K_TAIL) {
        return blk;
    }
    let inside = k_inside(k, k_len);
    return mat4x4<f32>(select(vec4<f32>(0.0), blk[0], inside), select(vec4<f32>(0.0), blk[1], inside),
                       select(vec4<f32>(0.0), blk[2], inside), select(vec4<f32>(0.0), blk[3], inside));
}

// The elements of A (of B) at four element offsets.
fn a_at4(o: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(a_at(o.x), a_at(o.y), a_at(o.z), a_at(o.w));
}

fn b_at4(o: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(b_at(o.x), b_at(o.y), b_at(o.z), b_at(o.w));
}

// The outer product of a column of 4 rows of A and a row of 4 columns of B: column j holds
// a * b[j].
fn outer(a: vec4<f32>, b: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(a * b.x, a * b.y, a * b.z, a * b.w);
}

// Stores an 8x8 block of batch `batch`'s out, kept as four 4x4 accumulators whose column j
// holds 4 rows of one output column: `ll` rows row0.. and columns col0..; `hl` rows row0 + hi.x..; `lh`
// columns col0 + hi.y..; `hh` both (`hi` is (4, 4) for a whole 8x8 block, half the tile
// side for the split one of `block_product`). One rolled loop picks each row's 4 columns
// with selects: 16 unrolled stores compiled into 16 loops over lanes (software adapters),
// which tripled small_tiled's compile time.
fn store_block8(batch: u32, row0: u32, col0: u32, hi: vec2<u32>, ll: mat4x4<f32>, hl: mat4x4<f32>,
                lh: mat4x4<f32>, hh: mat4x4<f32>) {
    // Transposed, column i of each accumulator is one output row's 4 columns.
    let ll_rows = transpose(ll);
    let hl_rows = transpose(hl);
    let lh_rows = transpose(lh);
    let hh_rows = transpose(hh);
    for (var i = 0u; i < rolled(16u); i = i + 1u) {
        let r = i % 8u;
        let right = i >= 8u;
        let rows = pick(pick(ll_rows, hl_rows, r >= 4u), pick(lh_rows, hh_rows, r >= 4u), right);
        let row = row0 + r % 4u + select(0u, hi.x, r >= 4u);
        let col = col0 + select(0u, hi.y, right);
        let out_col = out_column_B_SOURCE(batch, col);
        store_row_at(out_col.at + row * out_col.row_stride, row, col, column_of(rows, r % 4u));
    }
}

// 8 rows x 256 columns per workgroup: all 32 invocations share the 8 rows (A in two 4-row
// halves), invocation `lid` owns 8 columns from col0 + 8 lid (B in two 4-column halves, each
// read from a matrix or from images as B_SOURCE says).
// Each step of 4 along k loads two 4x4 blocks of A and two of B and does 256 multiply-adds;
// the four accumulators are 4x4 blocks whose column j holds 4 rows of one output column.
// No workgroup memory, no barriers.
@compute @workgroup_size(32)
fn register_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let t = tile_of(wid, nwg, 8u, 256u);
    if (t.batch >= pu(MATMUL_BATCHES)) {
        return;
    }
    let k_len = pu(MATMUL_K);
    let a_base = pu(MATMUL_A_OFFSET) + t.batch * pu(MATMUL_A_BATCH_STRIDE);
    let a_rs = pu(MATMUL_A_ROW_STRIDE);
    let a_cs = pu(MATMUL_A_COL_STRIDE);
    let b_base = pu(MATMUL_B_OFFSET) + t.batch * pu(MATMUL_B_BATCH_STRIDE);
    let rows_lo = rows_from(t.row0);
    let rows_hi = rows_from(t.row0 + 4u);
    let col_lo = t.col0 + lid * 8u;
    // Invocations past the last column have nothing to store: they leave, on CPU adapters a
    // whole SIMD group at a time.
    if (col_lo >= pu(MATMUL_N)) {
        return;
    }
    let col_hi = col_lo + 4u;
    let cols_lo = cols_from(col_lo);
    let cols_hi = cols_from(col_hi);
    let a_lo = a_base + rows_lo.x * a_rs;
    let a_hi = a_base + rows_hi.x * a_rs;
    let b_lo = b_columns_B_SOURCE(b_base, cols_lo);
    let b_hi = b_columns_B_SOURCE(b_base, cols_hi);
    var step_lo = BStep();
    var step_hi = BStep();
    var acc_ll = mat4x4<f32>(); // rows_lo x cols_lo
    var acc_hl = mat4x4<f32>(); // rows_hi x cols_lo
    var acc_lh = mat4x4<f32>(); // rows_lo x cols_hi
    var acc_hh = mat4x4<f32>(); // rows_hi x cols_hi
    for (var k = 0u; k < k_steps(k_len); k = k + 4u) {
        let a_pair = a_pair(a_lo + k * a_cs, a_hi + k * a_cs, rows_lo, rows_hi, a_rs, a_cs);
        let a_blk_lo = masked_a_block(a_pair.lo, k, k_len);
        let a_blk_hi = masked_a_block(a_pair.hi, k, k_len);
        let b_blk_lo = masked_b_block(b_block_B_SOURCE(b_lo, &step_lo, k), k, k_len);
        let b_blk_hi = masked_b_block(b_block_B_SOURCE(b_hi, &step_hi, k), k, k_len);
        acc_ll = acc_ll + a_blk_lo * b_blk_lo;
        acc_hl = acc_hl + a_blk_hi * b_blk_lo;
        acc_lh = acc_lh + a_blk_lo * b_blk_hi;
        acc_hh = acc_hh + a_blk_hi * b_blk_hi;
    }
    store_block8(t.batch, t.row0, col_lo, vec2<u32>(4u), acc_ll, acc_hl, acc_lh, acc_hh);
}

// Small products (a dim under 16, as a classifier head's 10 classes): each invocation owns one
// 8x8 block of out, blocks packed row block first so that every lane has one whatever the
// shape, and reads A and B element by element through their strides (16 loads per 64
// multiply-adds). One module serves every layout and shape: a small product is cheap to run,
// while each specialisation of the register kernels costs a software adapter 0.2 to 0.45 s to
// compile. Workgroups of 16 spread even a few blocks over the adapter's threads.
@compute @workgroup_size(16)
fn small_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let g = workgroup_index(wid, nwg) * 16u + lid;
    let row_blocks = pu(MATMUL_ROW_TILES);
    let per_batch = row_blocks * pu(MATMUL_COL_TILES);
    let batch = g / per_batch;
    if (batch >= pu(MATMUL_BATCHES)) {
        return;
    }
    let in_batch = g - batch * per_batch;
    let row0 = (in_batch % row_blocks) * 8u;
    let col0 = (in_batch / row_blocks) * 8u;
    let a_base = pu(MATMUL_A_OFFSET) + batch * pu(MATMUL_A_BATCH_STRIDE);
    let b_base = pu(MATMUL_B_OFFSET) + batch * pu(MATMUL_B_BATCH_STRIDE);
    let a_rs = pu(MATMUL_A_ROW_STRIDE);
    let a_cs = pu(MATMUL_A_COL_STRIDE);
    let b_rs = pu(MATMUL_B_ROW_STRIDE);
    let b_cs = pu(MATMUL_B_COL_STRIDE);
    // Element offsets of the block's rows of A and columns of B (clamped at the edges).
    let ra = rows_from(row0) * a_rs + a_base;
    let rb = rows_from(row0 + 4u) * a_rs + a_base;
    let ca = cols_from(col0) * b_cs + b_base;
    let cb = cols_from(col0 + 4u) * b_cs + b_base;
    var acc_ll = mat4x4<f32>(); // rows row0.., cols col0..
    var acc_hl = mat4x4<f32>(); // rows row0 + 4.., cols col0..
    var acc_lh = mat4x4<f32>(); // rows row0.., cols col0 + 4..
    var acc_hh = mat4x4<f32>();
    for (var k = 0u; k < pu(MATMUL_K); k = k + 1u) {
        let ao = k * a_cs;
        let bo = k * b_rs;
        let a_lo = a_at4(ra + ao);
        let a_hi = a_at4(rb + ao);
        let b_lo = b_at4(ca + bo);
        let b_hi = b_at4(cb + bo);
        acc_ll = acc_ll + outer(a_lo, b_lo);
        acc_hl = acc_hl + outer(a_hi, b_lo);
        acc_lh = acc_lh + outer(a_lo, b_hi);
        acc_hh = acc_hh + outer(a_hi, b_hi);
    }
    store_block8(batch, row0, col0, vec2<u32>(4u), acc_ll, acc_hl,
                 acc_lh, acc_hh);
}

// The product's sizes, and where batch `batch`'s A and B start and their strides (elements).
struct Operands {
    m: u32,
    n: u32,
    k_len: u32,
    a_base: u32,
    a_rs: u32,
    a_cs: u32,
    b_base: u32,
    b_rs: u32,
    b_cs: u32,
}

fn operands_of(batch: u32) -> Operands {
    return Operands(pu(MATMUL_M), pu(MATMUL_N), pu(MATMUL_K), pu(MATMUL_A_OFFSET) + batch * pu(MATMUL_A_BATCH_STRIDE), pu(MATMUL_A_ROW_STRIDE),
                    pu(MATMUL_A_COL_STRIDE), pu(MATMUL_B_OFFSET) + batch * pu(MATMUL_B_BATCH_STRIDE),
                    pu(MATMUL_B_ROW_STRIDE), pu(MATMUL_B_COL_STRIDE));
}

// Rows of k in a block kernel's panel (spliced): 16 where the device's workgroup storage
// holds the panels below at that depth (32 KiB), else 8 (16 KiB, WebGPU's default). Deeper
// panels halve the barriers per k; on llvmpipe, where a barrier switches every SIMD group's
// coroutine and moves its accumulators through memory, they ran the product 1.3x faster.
const BLOCK_K: u32 = BLOCK_K_ROWSu;
// The block kernels' panels of A and B, k-major, four rows (columns) to a vec4, two of each
// (double-buffered: one is read while the next is written): [2][BLOCK_K][block / 4], sized
// for the 128 block (the 64 block uses half).
var<workgroup> a_block: array<vec4<f32>, 2u * BLOCK_K * 32u>;
var<workgroup> b_block: array<vec4<f32>, 2u * BLOCK_K * 32u>;
// Vec4s of one panel buffer of A (of B): BLOCK_K x 128 / 4.
const PANEL: u32 = BLOCK_K * 32u;
// Elements of a panel an invocation stages: BLOCK_K x block / (block / 8)^2, BLOCK_K / 2 for
// the 128 block, BLOCK_K for the 64.
const PANEL_LOADS: u32 = BLOCK_K;

// The element of a `block` x BLOCK_K panel that invocation `lid` (of `threads`) stages in its
// `j`th load: (k within the panel, row or column within the tile). Consecutive invocations
// read consecutive elements of the operand in memory: along k where k is its unit stride.
fn panel_element(lid: u32, j: u32, k_contiguous: bool, block: u32, threads: u32) -> vec2<u32> {
    let e = lid + j * threads;
    if (k_contiguous) {
        return vec2<u32>(e % BLOCK_K, e / BLOCK_K);
    }
    return vec2<u32>(e / block, e % block);
}

// The tile's first column `col0` and the column of B that a block kernel's invocation stages,
// `in_tile` columns into the tile (`lid % block`: the invocation count is a multiple of the
// block), and where that column is read: for an image source, the image's plane 0 offset and
// the window corner, computed once per workgroup so that the panel loop has no divisions
// along n.
struct PanelColumn {
    col0: u32,
    in_tile: u32,
    image_at: i32,
    y0: i32,
    x0: i32,
}

fn panel_column_matrix(o: Operands, col0: u32, in_tile: u32) -> PanelColumn {
    return PanelColumn(col0, in_tile, 0, 0, 0);
}

fn panel_column_image(o: Operands, col0: u32, in_tile: u32) -> PanelColumn {
    let c = b_columns_image(o.b_base, vec4<u32>(col0 + in_tile));
    return PanelColumn(col0, in_tile, c.image_at.x, c.y0.x, c.x0.x);
}

fn panel_column_image_t(o: Operands, col0: u32, in_tile: u32) -> PanelColumn {
    let c = b_columns_image_t(0u, vec4<u32>(col0 + in_tile));
    return PanelColumn(col0, in_tile, c.image_at.x, c.y0.x, c.x0.x);
}

// The elements of the A panel of rows `row0` .. `row0 + block`, k0 .. k0 + BLOCK_K that
// invocation `lid` (of (block / 8)^2) stages (see panel_element), 0 past the edges.
fn load_a_panel(o: Operands, row0: u32, lid: u32, k0: u32, block: u32) -> array<f32, PANEL_LOADS> {
    let threads = (block / 8u) * (block / 8u);
    var values: array<f32, PANEL_LOADS>;
    for (var j = 0u; j < BLOCK_K * block / threads; j = j + 1u) {
        let ea = panel_element(lid, j, o.a_cs == 1u, block, threads);
        let r = row0 + ea.y;
        if (k0 + ea.x < o.k_len && r < o.m) {
            values[j] = a_at(o.a_base + r * o.a_rs + (k0 + ea.x) * o.a_cs);
        }
    }
    return values;
}

// Where invocation `lid`'s `j`th element of a B panel goes: (k within the panel, column
// within the tile). A matrix is staged element by element in the order of its unit stride;
// from the images each invocation keeps its column and stages the rows `lid / block + j
// threads / block`, so that consecutive invocations read consecutive pixels of an image row.
fn b_panel_slot_matrix(o: Operands, column: PanelColumn, lid: u32, j: u32, block: u32) -> vec2<u32> {
    return panel_element(lid, j, o.b_rs == 1u, block, (block / 8u) * (block / 8u));
}

fn b_panel_slot_image(o: Operands, column: PanelColumn, lid: u32, j: u32, block: u32) -> vec2<u32> {
    let threads = (block / 8u) * (block / 8u);
    return vec2<u32>(lid / block + j * (threads / block), column.in_tile);
}

fn b_panel_slot_image_t(o: Operands, column: PanelColumn, lid: u32, j: u32, block: u32) -> vec2<u32> {
    return b_panel_slot_image(o, column, lid, j, block);
}

// The elements of the B panel of rows k0 .. k0 + BLOCK_K of the tile starting at column
// `column.col0` that invocation `lid` stages, 0 past the edges.
fn load_b_panel_matrix(o: Operands, column: PanelColumn, lid: u32, k0: u32, block: u32) -> array<f32, PANEL_LOADS> {
    let threads = (block / 8u) * (block / 8u);
    var values: array<f32, PANEL_LOADS>;
    for (var j = 0u; j < BLOCK_K * block / threads; j = j + 1u) {
        let eb = b_panel_slot_matrix(o, column, lid, j, block);
        let c = column.col0 + eb.y;
        if (k0 + eb.x < o.k_len && c < o.n) {
            values[j] = b_at(o.b_base + (k0 + eb.x) * o.b_rs + c * o.b_cs);
        }
    }
    return values;
}

// As load_b_panel_matrix, from the images: a row k is split into its tap (ty, tx) and channel
// by two divisions, which a GPU hides behind the loads.
fn load_b_panel_image(o: Operands, column: PanelColumn, lid: u32, k0: u32, block: u32) -> array<f32, PANEL_LOADS> {
    let threads = (block / 8u) * (block / 8u);
    let h = pu(MATMUL_CONV_HEIGHT);
    let w = pu(MATMUL_CONV_WIDTH);
    let c_in = pu(MATMUL_CONV_C_IN);
    let kernel_w = pu(MATMUL_CONV_KERNEL_W);
    var values: array<f32, PANEL_LOADS>;
    for (var j = 0u; j < BLOCK_K * block / threads; j = j + 1u) {
        let k = k0 + b_panel_slot_image(o, column, lid, j, block).x;
        let tap = k / c_in;
        let channel = k - tap * c_in;
        let ty = tap / kernel_w;
        let y = column.y0 + i32(ty * pu(MATMUL_CONV_DILATION_H));
        let x = column.x0 + i32((tap - ty * kernel_w) * pu(MATMUL_CONV_DILATION_W));
        if (k < pu(MATMUL_CONV_K) && column.col0 + column.in_tile < o.n && u32(y) < h && u32(x) < w) {
            values[j] = b_at(u32(column.image_at + i32(channel * h * w) + y * i32(w) + x));
        }
    }
    return values;
}

// As load_b_panel_image, from the transposed image columns (`image_t`): a row k is split
// into its image, output row and column by two divisions, which a GPU hides behind the loads.
fn load_b_panel_image_t(o: Operands, column: PanelColumn, lid: u32, k0: u32, block: u32) -> array<f32, PANEL_LOADS> {
    let threads = (block / 8u) * (block / 8u);
    let h = pu(MATMUL_CONV_HEIGHT);
    let w = pu(MATMUL_CONV_WIDTH);
    let ow = pu(MATMUL_CONV_OUT_W);
    let pixels = pu(MATMUL_CONV_PIXELS);
    var values: array<f32, PANEL_LOADS>;
    for (var j = 0u; j < BLOCK_K * block / threads; j = j + 1u) {
        let k = k0 + b_panel_slot_image_t(o, column, lid, j, block).x;
        let image = k / pixels;
        let p = k - image * pixels;
        let oy = p / ow;
        let y = column.y0 + i32(oy * pu(MATMUL_CONV_STRIDE_H));
        let x = column.x0 + i32((p - oy * ow) * pu(MATMUL_CONV_STRIDE_W));
        if (k < o.k_len && column.col0 + column.in_tile < o.n && u32(y) < h && u32(x) < w) {
            let image_at = i32(o.b_base + image * pu(MATMUL_CONV_C_IN) * h * w) + column.image_at;
            values[j] = b_at(u32(image_at + y * i32(w) + x));
        }
    }
    return values;
}

// Writes the elements invocation `lid` loaded (load_a_panel, load_b_panel_*) into panel
// buffer `buffer`.
fn store_panels(a: ptr<function, array<f32, PANEL_LOADS>>, b: ptr<function, array<f32, PANEL_LOADS>>, o: Operands,
                column: PanelColumn, lid: u32, buffer: u32, block: u32) {
    let threads = (block / 8u) * (block / 8u);
    let quads = block / 4u;
    for (var j = 0u; j < BLOCK_K * block / threads; j = j + 1u) {
        let ea = panel_element(lid, j, o.a_cs == 1u, block, threads);
        a_block[buffer * PANEL + ea.x * quads + ea.y / 4u][ea.y % 4u] = (*a)[j];
        let eb = b_panel_slot_B_SOURCE(o, column, lid, j, block);
        b_block[buffer * PANEL + eb.x * quads + eb.y / 4u][eb.y % 4u] = (*b)[j];
    }
}

// Four consecutive k of a panel's column of 4 rows of A (`at`, the first k's vec4; `quads`
// vec4s per k): column kk holds the rows at k + kk, so that (this) * (panel_b_block) sums
// the four k's outer products.
fn panel_a_block(at: u32, quads: u32) -> mat4x4<f32> {
    return mat4x4<f32>(a_block[at], a_block[at + quads], a_block[at + 2u * quads], a_block[at + 3u * quads]);
}

// Four consecutive k of a panel's row of 4 columns of B, transposed: column j holds column
// j's values at the four k.
fn panel_b_block(at: u32, quads: u32) -> mat4x4<f32> {
    return transpose(mat4x4<f32>(b_block[at], b_block[at + quads], b_block[at + 2u * quads], b_block[at + 3u * quads]));
}

// Where a block kernel's invocation works: `staging`, its index among the workgroup's
// invocations for staging panels (see panel_element); (`ty`, `tx`), its place in the tile's
// grid of invocations (rows ty*4.. and block/2 + ty*4.., columns tx*4.. and block/2 + tx*4..);
// `lane`, its lane in an 8-wide subgroup whose lanes share `ty` (the SUBGROUP SECTION's
// entries; 0 elsewhere).
struct BlockPlace {
    staging: u32,
    ty: u32,
    tx: u32,
    lane: u32,
}

// `block` x `block` outputs per workgroup of (block / 8)^2 invocations, 8 x 8 per invocation,
// for GPUs: each step of BLOCK_K along k reads a panel of A and of B from workgroup memory,
// every invocation 4 vec4s per k for 64 multiply-adds (the A pair through block_a_pair).
// Invocation (ty, tx) keeps rows ty*4.. and block/2 + ty*4.., columns tx*4.. and block/2 +
// tx*4.., so that the invocations reading one panel row read consecutive vec4s. The panels
// are double-buffered: an invocation loads its elements of the next panels into registers
// before this step's products (a GPU overlaps the loads with them) and writes them into the
// other buffer after, so each step has one barrier. The products go 4 k at a time as 4x4
// matrix products (block_a_pair, panel_b_block): the same loads and multiply-adds, with each
// accumulator updated once per 4 k, which software adapters keep in memory across the
// barrier (llvmpipe's coroutines): 10 % faster there. `block` is 128 or 64, a constant at
// each call, so every loop bound below folds.
fn block_product(wid: vec3<u32>, nwg: vec3<u32>, place: BlockPlace, block: u32) {
    let t = tile_of(wid, nwg, block, block);
    // Uniform across the workgroup, so the early return cannot split a barrier.
    if (t.batch >= pu(MATMUL_BATCHES)) {
        return;
    }
    let o = operands_of(t.batch);
    let side = block / 8u; // invocations along each side of the tile
    let quads = block / 4u; // vec4s per panel row
    var acc_ll = mat4x4<f32>();
    var acc_hl = mat4x4<f32>();
    var acc_lh = mat4x4<f32>();
    var acc_hh = mat4x4<f32>();
    let b_column = panel_column_B_SOURCE(o, t.col0, place.staging % block);
    var a_next = load_a_panel(o, t.row0, place.staging, 0u, block);
    var b_next = load_b_panel_B_SOURCE(o, b_column, place.staging, 0u, block);
    store_panels(&a_next, &b_next, o, b_column, place.staging, 0u, block);
    workgroupBarrier();
    var buffer = 0u;
    for (var k0 = 0u; k0 < o.k_len; k0 = k0 + BLOCK_K) {
        // Uniform across the workgroup, as the barrier below needs.
        let more = k0 + BLOCK_K < o.k_len;
        if (more) {
            a_next = load_a_panel(o, t.row0, place.staging, k0 + BLOCK_K, block);
            b_next = load_b_panel_B_SOURCE(o, b_column, place.staging, k0 + BLOCK_K, block);
        }
        let at = buffer * PANEL;
        for (var kk = 0u; kk < BLOCK_K; kk = kk + 4u) {
            let a_pair = block_a_pair(at + kk * quads, quads, side, place);
            let b_lo = panel_b_block(at + kk * quads + place.tx, quads);
            let b_hi = panel_b_block(at + kk * quads + side + place.tx, quads);
            acc_ll = acc_ll + a_pair.lo * b_lo;
            acc_hl = acc_hl + a_pair.hi * b_lo;
            acc_lh = acc_lh + a_pair.lo * b_hi;
            acc_hh = acc_hh + a_pair.hi * b_hi;
        }
        buffer = 1u - buffer;
        if (more) {
            store_panels(&a_next, &b_next, o, b_column, place.staging, buffer, block);
        }
        workgroupBarrier();
    }
    store_block8(t.batch, t.row0 + place.ty * 4u, t.col0 + place.tx * 4u, vec2<u32>(block / 2u), acc_ll,
                 acc_hl, acc_lh, acc_hh);
}

// SUBGROUP SECTION BEGIN: the block kernels on 8-wide subgroups.

// Each subgroup is 8 invocations of one tile row (one `ty`), placed by its subgroup id, so
// the lanes need the same A pair at each step: lane l loads the vec4 of rows at k + l % 4 (the
// rows of `lo` for l < 4, of `hi` after) and the subgroup assembles both blocks with
// subgroupBroadcast. One load per lane, not 8: inside a loop, llvmpipe runs each
// workgroup-memory load as a loop over its lanes, and sharing A ran the product 1.3x faster
// there.
fn block_a_pair(at: u32, quads: u32, side: u32, place: BlockPlace) -> APair {
    let v = a_block[at + place.ty + (place.lane % 4u) * quads + (place.lane / 4u) * side];
    return APair(broadcast_lo(v), broadcast_hi(v));
}

// The place of lane `lane` of subgroup `subgroup` in a tile of side x side invocations.
fn lanes_place(subgroup: u32, lane: u32, side: u32) -> BlockPlace {
    let per_row = side / 8u; // subgroups per tile row
    return BlockPlace(subgroup * 8u + lane, subgroup / per_row, (subgroup % per_row) * 8u + lane, lane);
}

// 128 x 128 tiles: products of at least 128 rows and columns.
@compute @workgroup_size(256)
fn block_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(subgroup_id) subgroup: u32, @builtin(subgroup_invocation_id) lane: u32) {
    block_product(wid, nwg, lanes_place(subgroup, lane, 16u), 128u);
}

// 64 x 64 tiles: products of at least 64 rows and columns, fewer than 128 on a side.
@compute @workgroup_size(64)
fn block_tiled_64(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(subgroup_id) subgroup: u32, @builtin(subgroup_invocation_id) lane: u32) {
    block_product(wid, nwg, lanes_place(subgroup, lane, 8u), 64u);
}

// SUBGROUP SECTION ELSE: the block kernels where every invocation reads its own A.

// The A pair for rows ty*4.. (`lo`) and block/2 + ty*4.. (`hi`) at four consecutive k from
// `at`, the panel's vec4 of its first row group at the first k.
fn block_a_pair(at: u32, quads: u32, side: u32, place: BlockPlace) -> APair {
    return APair(panel_a_block(at + place.ty, quads), panel_a_block(at + side + place.ty, quads));
}

// The place of invocation `lid` in a tile of side x side invocations.
fn invocation_place(lid: u32, side: u32) -> BlockPlace {
    return BlockPlace(lid, lid / side, lid % side, 0u);
}

// 128 x 128 tiles: products of at least 128 rows and columns.
@compute @workgroup_size(256)
fn block_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    block_product(wid, nwg, invocation_place(lid, 16u), 128u);
}

// 64 x 64 tiles: products of at least 64 rows and columns, fewer than 128 on a side.
@compute @workgroup_size(64)
fn block_tiled_64(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    block_product(wid, nwg, invocation_place(lid, 8u), 64u);
}

// SUBGROUP SECTION END
