// LayerNorm and RMSNorm over the last dim, fused: one invocation per row (`forward`,
// `backward`), or on the GPU flavour a workgroup per row (`*_rows`, WORKGROUP ROWS). RMSNorm
// (NORM_CENTER 0) is LayerNorm without the mean and without a bias (the host binds the
// weight in the bias's place and the kernel reads none). Params: `NormParams`
// (src/ops/norm.rs). x, the out grad and every output are contiguous [rows, len]. Rows are
// read four features at a time: with ALIGNED (len and every offset multiples of 4) as one
// vec4 load each, else element by element, zero past the row's end. (Element loads cost a
// lane loop each on CPU adapters.)
// No loop inside a row's loops: llvmpipe counts every loop iteration of an invocation against
// its limit of 65,535, and rows run to FUSED_MAX_LEN (16,384) elements in up to five passes
// (four groups of elements per iteration: 20,480 iterations at most).

const ALIGNED: bool = NORM_ALIGNED;

@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> weight: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> bias: array<vec4<f32>>;
// forward: the output. backward: the input grad. Both written through `store_group` (a vec4
// per four features where ALIGNED: software adapters pay per store, as per load), so that a
// captured step can run the elementwise ops consuming either in the stores.
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
// [rows, 2]: mean (0 for RMSNorm) and 1 / sqrt(var + eps) of each row (written forward,
// read backward); RMSNorm's "var" is the mean square.
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
// backward: the out grad.
@group(0) @binding(6) var<storage, read> grad: array<vec4<f32>>;
// weight_grads: [chunks, 4 * groups] partial column sums over WEIGHT_GRAD_ROWS rows each, of
// grad * xhat (the weight grad's) and of grad (the bias grad's); the host sums the chunks.
@group(0) @binding(7) var<storage, read_write> weight_partials: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> bias_partials: array<vec4<f32>>;

// EPILOGUE SECTION BEGIN
// How the forward and the backward store out[o..o+4] (o a multiple of 4) and out[o]. A
// captured step's fuser replaces this section with stores that first run the elementwise ops
// consuming the output (an activation, a residual add), so that they cost no pass of their
// own (src/capture/passes/epilogue.rs).
fn store4(o: u32, v: vec4<f32>) {
    out[o / 4u] = v;
}

fn store1(o: u32, v: f32) {
    out[o / 4u][o % 4u] = v;
}
// EPILOGUE SECTION END

// True for the lanes of elements at..at+4 before `end`.
fn inside(at: u32, end: u32) -> vec4<bool> {
    return vec4<u32>(at) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(end);
}

// Elements at..at+4 of x (weight, bias, the out grad), zero from `end` on. Elements past the
// end are read and dropped (WGSL defines a read past a binding: some element of it, or 0),
// with no branch or loop per element (see above).
fn x4(at: u32, end: u32) -> vec4<f32> {
    if (ALIGNED) {
        return x[at / 4u];
    }
    let v = vec4<f32>(x[at / 4u][at % 4u], x[(at + 1u) / 4u][(at + 1u) % 4u],
                      x[(at + 2u) / 4u][(at + 2u) % 4u], x[(at + 3u) / 4u][(at + 3u) % 4u]);
    return select(vec4<f32>(0.0), v, inside(at, end));
}

fn weight4(at: u32, end: u32) -> vec4<f32> {
    if (ALIGNED) {
        return weight[at / 4u];
    }
    let v = vec4<f32>(weight[at / 4u][at % 4u], weight[(at + 1u) / 4u][(at + 1u) % 4u],
                      weight[(at + 2u) / 4u][(at + 2u) % 4u], weight[(at + 3u) / 4u][(at + 3u) % 4u]);
    return select(vec4<f32>(0.0), v, inside(at, end));
}

fn bias4(at: u32, end: u32) -> vec4<f32> {
    if (ALIGNED) {
        return bias[at / 4u];
    }
    let v = vec4<f32>(bias[at / 4u][at % 4u], bias[(at + 1u) / 4u][(at + 1u) % 4u],
                      bias[(at + 2u) / 4u][(at + 2u) % 4u], bias[(at + 3u) / 4u][(at + 3u) % 4u]);
    return select(vec4<f32>(0.0), v, inside(at, end));
}

fn grad4(at: u32, end: u32) -> vec4<f32> {
    if (ALIGNED) {
        return grad[at / 4u];
    }
    let v = vec4<f32>(grad[at / 4u][at % 4u], grad[(at + 1u) / 4u][(at + 1u) % 4u],
                      grad[(at + 2u) / 4u][(at + 2u) % 4u], grad[(at + 3u) / 4u][(at + 3u) % 4u]);
    return select(vec4<f32>(0.0), v, inside(at, end));
}

// How many of elements 4c..4c+4 lie in a row of `len`.
fn lanes(c: u32, len: u32) -> u32 {
    if (ALIGNED) {
        return 4u;
    }
    return min(4u, len - 4u * c);
}

// Stores elements 4c..4c+4 of a row (those inside it) at out[o..]: one vec4 where ALIGNED.
fn store_group(o: u32, v: vec4<f32>, c: u32, len: u32) {
    if (ALIGNED) {
        store4(o, v);
        return;
    }
    let n = lanes(c, len);
    store1(o, v.x);
    if (n > 1u) {
        store1(o + 1u, v.y);
    }
    if (n > 2u) {
        store1(o + 2u, v.z);
    }
    if (n > 3u) {
        store1(o + 3u, v.w);
    }
}

fn sum4(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// The row of x that `row` names: where it starts and ends.
fn x_row(row: u32) -> vec2<u32> {
    let base = pu(NORM_X_OFFSET) + row * pu(NORM_LEN);
    return vec2<u32>(base, base + pu(NORM_LEN));
}

// x - mean at elements 4c..4c+4 of the row from `base` to `end`, zero past its end.
fn deviation4(base: u32, end: u32, c: u32, mean: f32) -> vec4<f32> {
    let d = x4(base + 4u * c, end) - mean;
    if (ALIGNED) {
        return d;
    }
    return select(vec4<f32>(0.0), d, inside(base + 4u * c, end));
}

// The forward's output at elements 4c..4c+4 of row `row`, stored:
// (x - mean) rstd weight + bias (LayerNorm), or x rstd weight (RMSNorm, mean 0).
fn store_normalised(row: u32, c: u32, mean: f32, rstd: f32) {
    let len = pu(NORM_LEN);
    let x = x_row(row);
    let w_at = pu(NORM_WEIGHT_OFFSET);
    let b_at = pu(NORM_BIAS_OFFSET);
    var b = vec4<f32>(0.0);
    if (pu(NORM_CENTER) == 1u) {
        b = bias4(b_at + 4u * c, b_at + len);
    }
    let y = (x4(x.x + 4u * c, x.y) - mean) * rstd * weight4(w_at + 4u * c, w_at + len) + b;
    store_group(row * len + 4u * c, y, c, len);
}

// The backward's terms at elements 4c..4c+4 of row `row`, whose statistics `stat` are
// (mean, rstd): gw = grad * weight and xhat = (x - mean) rstd, both zero past the row's end
// (grad and weight read as 0 there; xhat is masked, as its sum is taken).
struct GradTerms {
    gw: vec4<f32>,
    xhat: vec4<f32>,
}

fn grad_terms(row: u32, c: u32, stat: vec2<f32>) -> GradTerms {
    let len = pu(NORM_LEN);
    let x = x_row(row);
    let g_base = pu(NORM_GRAD_OFFSET) + row * len;
    let w_at = pu(NORM_WEIGHT_OFFSET);
    let xhat = select(vec4<f32>(0.0), (x4(x.x + 4u * c, x.y) - stat.x) * stat.y,
                      inside(x.x + 4u * c, x.y));
    let gw = grad4(g_base + 4u * c, g_base + len) * weight4(w_at + 4u * c, w_at + len);
    return GradTerms(gw, xhat);
}

// The input grad at elements 4c..4c+4 of row `row`, stored, given the row's mean of gw and
// the co-moment of gw and xhat (see `grad_means`): rstd (gw - mean(gw) - xhat comoment).
fn store_input_grad(row: u32, c: u32, stat: vec2<f32>, means: vec2<f32>) {
    let t = grad_terms(row, c, stat);
    let dx = stat.y * (t.gw - means.x - t.xhat * means.y);
    store_group(row * pu(NORM_LEN) + 4u * c, dx, c, pu(NORM_LEN));
}

// The mean of gw (0 for RMSNorm) over a row of `len`, and the co-moment of gw and xhat,
// mean(gw xhat) - mean(gw) mean(xhat), from the sums of gw, gw xhat and xhat. xhat's mean
// is 0 in exact arithmetic, but a row far from 0 rounds its f32 mean an ulp off, and 1 / sigma
// magnifies the recomputed xhat's mean past 1e-3 of it: the co-moment cancels it, where
// mean(gw xhat) alone kept it (the grad of a LayerNorm's summed outputs, 0, read 0.017).
fn grad_means(sums: vec3<f32>, len: u32) -> vec2<f32> {
    let mean_gw = select(0.0, sums.x / f32(len), pu(NORM_CENTER) == 1u);
    return vec2<f32>(mean_gw, sums.y / f32(len) - mean_gw * (sums.z / f32(len)));
}

// The row's mean and its squared deviations' sum, from `mean` (the row's sum over `len`) and
// `sums` (the squared deviations from `mean`, the deviations themselves and the scaled
// squares, summed: see `Deviations`). The sum's
// rounding can put `mean` an ulp or two off a row of equal values, which the output's
// 1 / sqrt(eps) magnified (0.2501 for a bias of 0.25); the deviations sum to len times that
// error, so adding their mean makes it exact there, as torch's running mean is (the
// corrected two-pass algorithm). RMSNorm (no centre) keeps its mean of 0.
struct RowStats {
    mean: f32,
    // The squared deviations from `mean`, summed; inf where they overflow f32.
    squares: f32,
    // The same scaled by SQUARES_SCALE squared, for rows whose squares overflow.
    scaled_squares: f32,
}

fn corrected(mean: f32, sums: vec3<f32>, len: u32) -> RowStats {
    if (pu(NORM_CENTER) != 1u) {
        return RowStats(mean, sums.x, sums.z);
    }
    let shift = sums.y / f32(len);
    let squares = select(max(sums.x - sums.y * shift, 0.0), sums.x, !(sums.x <= 3.0e38));
    let scaled = max(sums.z - (sums.y * SQUARES_SCALE) * (shift * SQUARES_SCALE), 0.0);
    return RowStats(mean + shift, squares, scaled);
}

// 2^-100, exact: the deviations of a row whose squares overflow, scaled by it, square and
// sum without overflow (the largest f32 gives 7e16) and lose nothing in the scaling; the
// deviations it sends below f32's normal range are under 2^-26 where the largest exceeds
// 1e14, too small to count in such a sum.
const SQUARES_SCALE: f32 = 7.888609052210118e-31;

// The deviations d of a row, summed four lanes apart: d^2, d, and (d SQUARES_SCALE)^2. The
// scaled squares are summed beside the plain ones, in the same loop, rather than in a second
// pass over the row for the rare rows whose squares overflow (past about 1e19): each pass is
// a load site, which costs lavapipe compile time.
struct Deviations {
    squares: vec4<f32>,
    sum: vec4<f32>,
    scaled_squares: vec4<f32>,
}

fn add_deviation(sums: Deviations, d: vec4<f32>) -> Deviations {
    let scaled = d * SQUARES_SCALE;
    return Deviations(sums.squares + d * d, sums.sum + d, sums.scaled_squares + scaled * scaled);
}

// 1 / sqrt(var + eps) of a row of `len` with these sums. A row whose squares overflow but
// whose scaled squares do not (values up to 1e30 over 16,384) gets its O(1) output from the
// scaled ones; eps is then far below what the variance rounds away. NaN stays NaN.
fn row_rstd(stats: RowStats, len: u32) -> f32 {
    if (!(stats.squares > 3.0e38)) {
        return inverseSqrt(stats.squares / f32(len) + pf(NORM_EPS));
    }
    return inverseSqrt(stats.scaled_squares / f32(len)) * SQUARES_SCALE;
}

// y = (x - mean) / sqrt(var + eps) * weight + bias, var biased (as PyTorch).
@compute @workgroup_size(64)
fn forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 64u + lid;
    if (row >= pu(NORM_ROWS)) {
        return;
    }
    let len = pu(NORM_LEN);
    let groups = (len + 3u) / 4u;
    let x = x_row(row);
    var sum = vec4<f32>(0.0);
    for (var c = 0u; c < select(0u, groups, pu(NORM_CENTER) == 1u); c = c + 1u) {
        sum = sum + x4(x.x + 4u * c, x.y);
    }
    let first_mean = sum4(sum) / f32(len);
    var sums = Deviations(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var c = 0u; c < groups; c = c + 1u) {
        sums = add_deviation(sums, deviation4(x.x, x.y, c, first_mean));
    }
    let stat = corrected(first_mean, vec3<f32>(sum4(sums.squares), sum4(sums.sum), sum4(sums.scaled_squares)), len);
    let mean = stat.mean;
    let rstd = row_rstd(stat, len);
    for (var c = 0u; c < groups; c = c + 1u) {
        store_normalised(row, c, mean, rstd);
    }
    stats[2u * row] = mean;
    stats[2u * row + 1u] = rstd;
}

// dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) with gw = grad * weight and
// xhat = (x - mean) * rstd (RMSNorm: no mean(gw) term, mean 0); mean(gw * xhat) taken as
// the co-moment (see `grad_means`).
@compute @workgroup_size(64)
fn backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 64u + lid;
    if (row >= pu(NORM_ROWS)) {
        return;
    }
    let len = pu(NORM_LEN);
    let groups = (len + 3u) / 4u;
    let stat = vec2<f32>(stats[2u * row], stats[2u * row + 1u]);
    var sum_gw = vec4<f32>(0.0);
    var sum_gw_xhat = vec4<f32>(0.0);
    var sum_xhat = vec4<f32>(0.0);
    for (var c = 0u; c < groups; c = c + 1u) {
        let t = grad_terms(row, c, stat);
        sum_gw = sum_gw + t.gw;
        sum_gw_xhat = sum_gw_xhat + t.gw * t.xhat;
        sum_xhat = sum_xhat + t.xhat;
    }
    let means = grad_means(vec3<f32>(sum4(sum_gw), sum4(sum_gw_xhat), sum4(sum_xhat)), len);
    for (var c = 0u; c < groups; c = c + 1u) {
        store_input_grad(row, c, stat, means);
    }
}

// The weight and bias grads' partial sums: invocation i sums features 4c..4c+4
// (c = i % groups) over the WEIGHT_GRAD_ROWS rows of chunk i / groups, recomputing xhat from x
// and the row's stats, so that no [rows, len] tensor of grad * xhat is ever stored. Neighbour
// invocations read neighbour features of one row (coalesced on a GPU).
const WEIGHT_GRAD_ROWS: u32 = 64u;

@compute @workgroup_size(64)
fn weight_grads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 64u + lid;
    let rows = pu(NORM_ROWS);
    let len = pu(NORM_LEN);
    let groups = (len + 3u) / 4u;
    let chunks = (rows + WEIGHT_GRAD_ROWS - 1u) / WEIGHT_GRAD_ROWS;
    if (i >= chunks * groups) {
        return;
    }
    let c = i % groups;
    let chunk = i / groups;
    let first = chunk * WEIGHT_GRAD_ROWS;
    let count = min(WEIGHT_GRAD_ROWS, rows - first);
    var sum_g_xhat = vec4<f32>(0.0);
    var sum_g = vec4<f32>(0.0);
    for (var r = 0u; r < count; r = r + 1u) {
        let row = first + r;
        let x_row = pu(NORM_X_OFFSET) + row * len;
        let g_row = pu(NORM_GRAD_OFFSET) + row * len;
        let xhat = (x4(x_row + 4u * c, x_row + len) - stats[2u * row]) * stats[2u * row + 1u];
        let g = grad4(g_row + 4u * c, g_row + len);
        sum_g_xhat = sum_g_xhat + g * xhat;
        sum_g = sum_g + g;
    }
    weight_partials[chunk * groups + c] = sum_g_xhat;
    bias_partials[chunk * groups + c] = sum_g;
}

// ROWS OF LANES: the GPU flavour's forward and backward (`forward_rows`, `backward_rows`). A
// group of lanes owns one row (row_group.wgsl: a workgroup of 64, or a subgroup for rows
// under WORKGROUP_ROW_LEN where the device has subgroups of a fixed width): lane `l` reads the
// groups of 4 features l, l + lanes, ..., so that neighbour invocations read neighbour vec4s
// (coalesced), and the row's sums are combined over the lanes. The sums are the same as the
// per-row kernels', in another order.

var<workgroup> row_parts: array<vec3<f32>, 64>;
var<workgroup> row_total: vec3<f32>;

// ROW_GROUP is spliced: workgroup_row or subgroup_row (row_group.wgsl).
fn row_group(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> RowGroup {
    return ROW_GROUP(wid, nwg, lid, 64u, pu(NORM_ROWS));
}

// The sum of `v` over the row's lanes, uniform: every lane gets it. ROW_REDUCE is
// spliced: row_reduce_subgroups for a workgroup where the device has subgroups of a fixed
// width (two barriers), row_reduce_tree for one where it has not (seven: software adapters
// run each as a coroutine switch of every SIMD group), row_reduce_in_subgroup for a subgroup.
fn row_reduce(g: RowGroup, v: vec3<f32>) -> vec3<f32> {
    return ROW_REDUCE(g.lane, v);
}

fn row_reduce_tree(lid: u32, v: vec3<f32>) -> vec3<f32> {
    row_parts[lid] = v;
    workgroupBarrier();
    for (var width = 32u; width > 0u; width = width / 2u) {
        if (lid < width) {
            let other = row_parts[lid + width];
            row_parts[lid] = row_parts[lid] + other;
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        row_total = row_parts[0];
    }
    return workgroupUniformLoad(&row_total);
}

// SUBGROUP SECTION BEGIN: kept only where the device has subgroups of a fixed width.
// Each subgroup sums its lanes, its first lane writes the sum at the subgroup's index (the
// subgroups of a one-dimensional workgroup hold consecutive invocations, as on every adapter
// wgrad knows), and invocation 0 combines the 64 / width sums.
fn row_reduce_subgroups(lid: u32, v: vec3<f32>) -> vec3<f32> {
    let s = subgroupAdd(v);
    let width = subgroupAdd(1u);
    if (subgroupExclusiveAdd(1u) == 0u) {
        row_parts[lid / width] = s;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var total = row_parts[0];
        for (var j = 1u; j < 64u / width; j = j + 1u) {
            total = total + row_parts[j];
        }
        row_total = total;
    }
    return workgroupUniformLoad(&row_total);
}

// The sum of `v` over the subgroup: no barrier.
fn row_reduce_in_subgroup(lane: u32, v: vec3<f32>) -> vec3<f32> {
    return subgroupAdd(v);
}
// SUBGROUP SECTION END

// forward, a group of lanes per row.
@compute @workgroup_size(64)
fn forward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    // The loop's bounds are uniform across a row's lanes, so every lane of a row meets the
    // reductions' barriers.
    for (var g = row_group(wid, nwg, lid); g.row < g.end; g.row = g.row + g.step) {
        forward_row(g);
    }
}

// One row of `forward_rows`.
fn forward_row(g: RowGroup) {
    let row = g.row;
    let len = pu(NORM_LEN);
    let groups = (len + 3u) / 4u;
    let x = x_row(row);
    var sum = vec4<f32>(0.0);
    for (var c = g.lane; c < select(0u, groups, pu(NORM_CENTER) == 1u); c = c + g.lanes) {
        sum = sum + x4(x.x + 4u * c, x.y);
    }
    let first_mean = row_reduce(g, vec3<f32>(sum4(sum), 0.0, 0.0)).x / f32(len);
    var sums = Deviations(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var c = g.lane; c < groups; c = c + g.lanes) {
        sums = add_deviation(sums, deviation4(x.x, x.y, c, first_mean));
    }
    let row_sums = row_reduce(g, vec3<f32>(sum4(sums.squares), sum4(sums.sum), 0.0)).xy;
    // The scaled squares are summed over the lanes only where the squares overflowed (the
    // same on every lane of the row, so every lane meets the reduction's barriers or none).
    var scaled = 0.0;
    if (!(row_sums.x <= 3.0e38)) {
        scaled = row_reduce(g, vec3<f32>(sum4(sums.scaled_squares), 0.0, 0.0)).x;
    }
    let stat = corrected(first_mean, vec3<f32>(row_sums, scaled), len);
    let mean = stat.mean;
    let rstd = row_rstd(stat, len);
    for (var c = g.lane; c < groups; c = c + g.lanes) {
        store_normalised(row, c, mean, rstd);
    }
    if (g.lane == 0u) {
        stats[2u * row] = mean;
        stats[2u * row + 1u] = rstd;
    }
}

// backward, a group of lanes per row.
@compute @workgroup_size(64)
fn backward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    for (var g = row_group(wid, nwg, lid); g.row < g.end; g.row = g.row + g.step) {
        backward_row(g);
    }
}

// One row of `backward_rows`.
fn backward_row(g: RowGroup) {
    let row = g.row;
    let len = pu(NORM_LEN);
    let groups = (len + 3u) / 4u;
    let stat = vec2<f32>(stats[2u * row], stats[2u * row + 1u]);
    var sum_gw = vec4<f32>(0.0);
    var sum_gw_xhat = vec4<f32>(0.0);
    var sum_xhat = vec4<f32>(0.0);
    for (var c = g.lane; c < groups; c = c + g.lanes) {
        let t = grad_terms(row, c, stat);
        sum_gw = sum_gw + t.gw;
        sum_gw_xhat = sum_gw_xhat + t.gw * t.xhat;
        sum_xhat = sum_xhat + t.xhat;
    }
    let sums = vec3<f32>(sum4(sum_gw), sum4(sum_gw_xhat), sum4(sum_xhat));
    let means = grad_means(row_reduce(g, sums), len);
    for (var c = g.lane; c < groups; c = c + g.lanes) {
        store_input_grad(row, c, stat, means);
    }
}
