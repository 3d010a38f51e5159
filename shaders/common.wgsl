// Prepended to every wgrad kernel: the uniform parameter block at binding 0 and index helpers.
// Each kernel's params are a Rust struct (`kernel_params!`); the module gets a named slot
// constant per field, read with `pu(NAME)`.

struct Params {
    v: array<vec4<u32>, 16>,
}

@group(0) @binding(0) var<uniform> params: Params;

// Parameter slot `i` as a u32. Slot 63 always holds 0: indexing through it keeps the offset
// of every parameter load opaque to the driver's compiler. Otherwise lavapipe inlines the
// parameters that decide branches and loop bounds as constants and, where that shrinks the
// shader enough, compiles the kernel again at every dispatch (milliseconds each, far more
// without a warm shader cache).
fn pu(i: u32) -> u32 {
    let opaque_zero = params.v[15].w;
    return params.v[(i / 4u) | opaque_zero][i % 4u];
}

// `n`, as a value the driver's compiler cannot know: a loop bounded by it stays rolled. Mesa
// unrolls loops with a constant count, and a kernel's compile time grows with every copy (a
// captured step's merged SGD update took 9 s to compile on llvmpipe's GL unrolled, 0.2 s
// rolled).
fn rolled(n: u32) -> u32 {
    return n + pu(63u); // slot 63 holds 0
}

// Parameter slot `i` as an f32 (stored as its bits).
fn pf(i: u32) -> f32 {
    return bitcast<f32>(pu(i));
}

// Elements one workgroup of a contiguous elementwise kernel covers (64 per invocation): fewer,
// fuller workgroups cost less to launch, above all on CPU adapters.
const CONTIGUOUS_PER_GROUP: u32 = 16384u;

// The `j`-th item (an element, or a vec4 where a kernel moves four at a time) that invocation
// `lid` of a contiguous kernel visits, for j = 0 .. per_group / 256, where `per_group` is the
// workgroup's item count (CONTIGUOUS_PER_GROUP, or a quarter of it for vec4s). Each run of 8
// neighbouring invocations covers one span, interleaved, so that every load instruction of a
// run touches neighbouring items: CPU adapters run such a run (a SIMD group) to completion
// before the next, and items a workgroup-width apart would alias in their caches (an add of
// 16M elements took 88 ms that way, 18 ms this way, on llvmpipe).
fn contiguous_item(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, j: u32, per_group: u32) -> u32 {
    return contiguous_item_at(workgroup_index(wid, nwg), lid, j, per_group);
}

// As contiguous_item, in workgroup `w` of the launch's grid (or of a tensor's part of it).
fn contiguous_item_at(w: u32, lid: u32, j: u32, per_group: u32) -> u32 {
    let per_invocation = per_group / 256u;
    let run_start = (lid / 8u) * 8u * per_invocation;
    return w * per_group + run_start + j * 8u + lid % 8u;
}

// Index of this workgroup in the 2-D grid the host dispatches (x runs to at most 65535).
fn workgroup_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.y * nwg.x + wid.x;
}

// Element offset of the `i`-th element (row-major over the 6 dims whose sizes start at slot
// `shape_at`) in a tensor whose strides start at slot `strides_at`. Only the last `rank` dims
// can be larger than 1.
fn strided_offset(i: u32, rank: u32, shape_at: u32, strides_at: u32) -> u32 {
    var rem = i;
    var off = 0u;
    for (var k = 0u; k < rank; k = k + 1u) {
        let d = 5u - k;
        let n = pu(shape_at + d);
        off = off + (rem % n) * pu(strides_at + d);
        rem = rem / n;
    }
    return off;
}

// erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), for the exact GELU.
fn erf_approx(v: f32) -> f32 {
    let a = abs(v);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return sign(v) * (1.0 - poly * exp(-a * a));
}

// d/dx of GELU's tanh form 0.5 x (1 + tanh(u)), u = k (x + c x^3): 0.5 (1 + t) + 0.5 x (1 - t^2) u'.
fn gelu_tanh_slope(x: f32) -> f32 {
    let k = 0.7978845608028654;
    let t = tanh(clamp(k * (x + 0.044715 * x * x * x), -20.0, 20.0));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 0.134145 * x * x);
}

// True for NaN, tested on the bits: drivers may fold `v != v` to false.
fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// The larger of a and b, NaN when either is (WGSL's max may return the other operand).
fn nan_max(a: f32, b: f32) -> f32 {
    return select(max(a, b), a + b, is_nan(a) || is_nan(b));
}

// The smaller of a and b, NaN when either is.
fn nan_min(a: f32, b: f32) -> f32 {
    return select(min(a, b), a + b, is_nan(a) || is_nan(b));
}

// A u32 mask element (0 or 1) as the f32 bits it is stored as through an f32 binding.
fn mask_bits(c: bool) -> f32 {
    return bitcast<f32>(select(0u, 1u, c));
}

fn nan_max4(a: vec4<f32>, b: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(nan_max(a.x, b.x), nan_max(a.y, b.y), nan_max(a.z, b.z), nan_max(a.w, b.w));
}

// x^s as C's powf (and torch's pow): negative bases with integral exponents keep their sign;
// x^0 = 1 and 1^s = 1 even for NaN; otherwise NaN in gives NaN; 0^s is 0 for s > 0 and inf
// for s < 0 (signed for -0 and odd integral s), where WGSL's pow is undefined.
fn pow_exact(x: f32, s: f32) -> f32 {
    if (s == 0.0 || x == 1.0) {
        return 1.0;
    }
    if (is_nan(x) || is_nan(s)) {
        return x + s;
    }
    // The exponents torch computes without pow (x * x for 2, a square root for 0.5, ...):
    // correctly rounded, where pow's exp2(s log2 x) is a few ulp off (x^2 of 100 was 9999.998).
    switch (bitcast<u32>(s)) {
        case 0x3f800000u: { return x; }                  // 1
        case 0x40000000u: { return x * x; }              // 2
        case 0x40400000u: { return x * x * x; }          // 3
        case 0xbf800000u: { return 1.0 / x; }            // -1
        case 0xc0000000u: { return 1.0 / (x * x); }      // -2
        case 0x3f000000u: { return sqrt(x); }            // 0.5
        case 0xbf000000u: { return 1.0 / sqrt(x); }      // -0.5, as rsqrt
        default: {}
    }
    let odd = abs(s % 2.0) == 1.0;
    if (x == 0.0) {
        let magnitude = select(0.0, bitcast<f32>(0x7f800000u), s < 0.0);
        let negative = bitcast<u32>(x) == 0x80000000u && odd;
        return select(magnitude, -magnitude, negative);
    }
    let m = pow(abs(x), s);
    if (x > 0.0) {
        return m;
    }
    if (s != floor(s)) {
        return bitcast<f32>(0x7fc00000u);
    }
    return select(m, -m, odd);
}
