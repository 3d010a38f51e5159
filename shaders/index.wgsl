// Ops that produce or consume u32 indices: argmax, index_select, gather. Elements move as raw
// 32-bit words (argmax reads them as f32), so the selecting kernels serve f32 and u32 alike.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
@group(0) @binding(3) var<storage, read> indices: array<u32>;

// The index of the first maximum of each row of an [M, K] strided view.
// params: 0 M, 1 K, 2 offset, 3 row stride, 4 k stride
@compute @workgroup_size(256)
fn argmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = workgroup_index(wid, nwg) * 256u + lid;
    if (row >= pu(0u)) {
        return;
    }
    let base = pu(2u) + row * pu(3u);
    var best = bitcast<f32>(src[base]);
    var best_k = 0u;
    for (var k = 1u; k < pu(1u); k = k + 1u) {
        let v = bitcast<f32>(src[base + k * pu(4u)]);
        if (v > best) {
            best = v;
            best_k = k;
        }
    }
    dst[row] = best_k;
}

// index_select of a contiguous tensor seen as [outer, dim, inner]:
// dst[o, j, i] = src[o, indices[j], i].
// params: 0 n, 1 selected count, 2 inner, 3 dim size, 4 src offset, 5 indices offset
@compute @workgroup_size(256)
fn index_select(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(0u)) {
        return;
    }
    let inner = pu(2u);
    let selected = pu(1u);
    let o = i / (selected * inner);
    let j = (i / inner) % selected;
    let idx = min(indices[pu(5u) + j], pu(3u) - 1u);
    dst[i] = src[pu(4u) + (o * pu(3u) + idx) * inner + i % inner];
}

// gather along `dim`: dst[..., j, ...] = src[..., indices[..., j, ...], ...], with dst shaped
// like the (contiguous) indices and src read through its strides.
// params: 0 n, 1 dim (0..6, counted in the padded 6 dims), 2 src offset, 3 indices offset,
//         4 size of src along dim, 5 rank, 6..12 shape of indices, 12..18 src strides
@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(0u)) {
        return;
    }
    let idx = min(indices[pu(3u) + i], pu(4u) - 1u);
    var rem = i;
    var off = pu(2u);
    for (var k = 0u; k < pu(5u); k = k + 1u) {
        let d = 5u - k;
        let n = pu(6u + d);
        var coord = rem % n;
        if (d == pu(1u)) {
            coord = idx;
        }
        off = off + coord * pu(12u + d);
        rem = rem / n;
    }
    dst[i] = src[off];
}
