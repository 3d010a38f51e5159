//! Elementwise binary ops with NumPy broadcasting, and the `std::ops` traits on `&Tensor`.
//! One WGSL template (`shaders/binary.wgsl`) is specialised with each op's expression.

use crate::error::{Error, Result};
use crate::kernel::{
    groups, windows, Elementwise, Fusion, Kernel, KernelParams, Launch, ShaderFamily,
    CONTIGUOUS_PER_GROUP, ELEMENTWISE_STORES_WGSL, SIXTEEN_BIT_WGSL,
};
use crate::ops::cast;
use crate::ops::too_large_view;
use crate::seed::next_seed;
use std::sync::Arc;

use crate::tensor::creation::{checked_host_numel, from_host_fn, uniform_values};
use crate::tensor::graph::record;
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::tape::HostBytes;
use crate::tensor::{DType, Layout, Tensor};

crate::kernel_params! {
    /// `contiguous` and `repeated` (each with a `_vec4` twin that reads four elements at a time
    /// where `n` is a multiple of 4 and each operand allows: `s` 1 with its offset and `p`
    /// multiples of 4, or `s` a multiple of 4). Stretches and periods (`repeated` only): an
    /// operand with stretch `s` and period `p` is a dense run of `p` elements, each held for
    /// `s` output elements, repeated along the leading dims (a bias row: `s` 1; a channel bias
    /// over `[N, C, H, W]`: `s` = H W, `p` = C): element `i` reads its element `(i / s) % p`;
    /// `s` 1 and `p` `n` mean a dense operand.
    pub(crate) struct BinaryParams {
        n: u32,
        lhs_offset: u32,
        rhs_offset: u32,
        lhs_period: u32,
        rhs_period: u32,
        lhs_stretch: u32,
        rhs_stretch: u32,
        scalar: f32,
    }
}

static BINARY: ShaderFamily = ShaderFamily {
    name: "binary",
    wgsl: include_str!("../../shaders/binary.wgsl"),
    params: &[&BinaryParams::LAYOUT],
    preludes: &[SIXTEEN_BIT_WGSL, ELEMENTWISE_STORES_WGSL],
};

/// The binary ops; each is one specialisation of the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    /// 1 where a > b, 0.5 where a == b, 0 elsewhere: how `maximum` splits its grad (and,
    /// with its operands swapped, `minimum`).
    MaximumShare,
    /// 1 where a == b, else 0 (which elements a `max` reduction picked).
    Equal,
    /// Backward rules: `a` is the incoming grad, `b` what the forward saved.
    ReluBackward,
    TanhBackward,
    SigmoidBackward,
    GeluBackward,
    GeluTanhBackward,
    SqrtBackward,
    ErfBackward,
    /// `a`, or the params' scalar where the u32 mask `b` is nonzero.
    MaskedFill,
    Minimum,
    /// `a^b` as C's powf (negative bases with integral exponents).
    Pow,
    /// `log(a)`, or 0 where `a` is 0 and `b >= 0`: the exponent's grad factor of `a^b`, as
    /// torch (0^b has grad 0 in b there).
    PowLogBase,
    /// Comparisons: u32 masks of 0/1, stored through the f32 binding as bits.
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    SinBackward,
    CosBackward,
    RsqrtBackward,
    SiluBackward,
    SoftplusBackward,
    LeakyReluBackward,
    /// Comparisons of two u32 tensors, on their values (exact at any size; an f32 comparison
    /// is exact only below 2^24): u32 masks of 0/1.
    EqU32,
    NeU32,
    LtU32,
    LeU32,
    GtU32,
    GeU32,
    /// `a` (u32), or 0 where the u32 mask `b` is nonzero: a u32 `where_cond`'s branches.
    ZeroWhereU32,
    /// The bitwise or of two u32 tensors: joins a u32 `where_cond`'s two zero-filled branches.
    OrU32,
}

impl BinaryOp {
    #[cfg(test)]
    const ALL: [BinaryOp; 38] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::MaximumShare,
        BinaryOp::Equal,
        BinaryOp::ReluBackward,
        BinaryOp::TanhBackward,
        BinaryOp::SigmoidBackward,
        BinaryOp::GeluBackward,
        BinaryOp::GeluTanhBackward,
        BinaryOp::SqrtBackward,
        BinaryOp::ErfBackward,
        BinaryOp::MaskedFill,
        BinaryOp::Minimum,
        BinaryOp::Pow,
        BinaryOp::PowLogBase,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::SinBackward,
        BinaryOp::CosBackward,
        BinaryOp::RsqrtBackward,
        BinaryOp::SiluBackward,
        BinaryOp::SoftplusBackward,
        BinaryOp::LeakyReluBackward,
        BinaryOp::EqU32,
        BinaryOp::NeU32,
        BinaryOp::LtU32,
        BinaryOp::LeU32,
        BinaryOp::GtU32,
        BinaryOp::GeU32,
        BinaryOp::ZeroWhereU32,
        BinaryOp::OrU32,
    ];

    fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::MaximumShare => "maximum_share",
            BinaryOp::Equal => "equal",
            BinaryOp::ReluBackward => "relu_backward",
            BinaryOp::TanhBackward => "tanh_backward",
            BinaryOp::SigmoidBackward => "sigmoid_backward",
            BinaryOp::GeluBackward => "gelu_backward",
            BinaryOp::GeluTanhBackward => "gelu_tanh_backward",
            BinaryOp::SqrtBackward => "sqrt_backward",
            BinaryOp::ErfBackward => "erf_backward",
            BinaryOp::MaskedFill => "masked_fill",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Pow => "pow",
            BinaryOp::PowLogBase => "pow_log_base",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
            BinaryOp::SinBackward => "sin_backward",
            BinaryOp::CosBackward => "cos_backward",
            BinaryOp::RsqrtBackward => "rsqrt_backward",
            BinaryOp::SiluBackward => "silu_backward",
            BinaryOp::SoftplusBackward => "softplus_backward",
            BinaryOp::LeakyReluBackward => "leaky_relu_backward",
            BinaryOp::EqU32 => "eq",
            BinaryOp::NeU32 => "ne",
            BinaryOp::LtU32 => "lt",
            BinaryOp::LeU32 => "le",
            BinaryOp::GtU32 => "gt",
            BinaryOp::GeU32 => "ge",
            BinaryOp::ZeroWhereU32 => "where_cond",
            BinaryOp::OrU32 => "where_cond",
        }
    }

    fn expr(self) -> &'static str {
        match self {
            BinaryOp::Add => "a + b",
            BinaryOp::Sub => "a - b",
            BinaryOp::Mul => "a * b",
            BinaryOp::Div => "a / b",
            BinaryOp::Maximum => "nan_max(a, b)",
            BinaryOp::MaximumShare => "select(select(0.0, 0.5, a == b), 1.0, a > b)",
            BinaryOp::Equal => "select(0.0, 1.0, a == b)",
            // As torch's threshold_backward: the grad passes unless x <= 0 (so it passes at NaN).
            BinaryOp::ReluBackward => "select(a, 0.0, b <= 0.0)",
            BinaryOp::TanhBackward => "a * (1.0 - b * b)",
            BinaryOp::SigmoidBackward => "a * b * (1.0 - b)",
            // d/dx x Phi(x) = Phi(x) + x phi(x)
            BinaryOp::GeluBackward => {
                "a * (0.5 * (1.0 + erf_approx(b * 0.7071067811865476)) + b * 0.3989422804014327 * exp(-0.5 * b * b))"
            }
            BinaryOp::GeluTanhBackward => "a * gelu_tanh_slope(b)",
            BinaryOp::SqrtBackward => "a * 0.5 / b",
            // d/dx erf(x) = 2 / sqrt(pi) e^(-x^2)
            BinaryOp::ErfBackward => "a * 1.1283791670955126 * exp(-b * b)",
            // The mask's u32 bits, read through the f32 binding unchanged.
            BinaryOp::MaskedFill => "select(a, s, bitcast<u32>(b) != 0u)",
            BinaryOp::Minimum => "nan_min(a, b)",
            BinaryOp::Pow => "pow_exact(a, b)",
            BinaryOp::PowLogBase => "select(log(a), 0.0, a == 0.0 && b >= 0.0)",
            BinaryOp::Eq => "mask_bits(a == b)",
            // Tested on the bits too: drivers may compile `!=` as an ordered comparison.
            BinaryOp::Ne => "mask_bits(a != b || is_nan(a) || is_nan(b))",
            BinaryOp::Lt => "mask_bits(a < b)",
            BinaryOp::Le => "mask_bits(a <= b)",
            BinaryOp::Gt => "mask_bits(a > b)",
            BinaryOp::Ge => "mask_bits(a >= b)",
            BinaryOp::SinBackward => "a * cos(b)",
            BinaryOp::CosBackward => "-a * sin(b)",
            // b is the output y = x^(-1/2): dy/dx = -y^3 / 2
            BinaryOp::RsqrtBackward => "a * -0.5 * b * b * b",
            // d/dx x s(x) = s(x) (1 + x (1 - s(x))), s the sigmoid
            BinaryOp::SiluBackward => {
                "a * (1.0 / (1.0 + exp(-b))) * (1.0 + b * (1.0 - 1.0 / (1.0 + exp(-b))))"
            }
            BinaryOp::SoftplusBackward => "select(a / (1.0 + exp(-b)), a, b > 20.0)",
            BinaryOp::LeakyReluBackward => "select(a * s, a, b > 0.0)",
            // u32 operands reach the expression as f32s of the same bits, unchanged.
            BinaryOp::EqU32 => "mask_bits(bitcast<u32>(a) == bitcast<u32>(b))",
            BinaryOp::NeU32 => "mask_bits(bitcast<u32>(a) != bitcast<u32>(b))",
            BinaryOp::LtU32 => "mask_bits(bitcast<u32>(a) < bitcast<u32>(b))",
            BinaryOp::LeU32 => "mask_bits(bitcast<u32>(a) <= bitcast<u32>(b))",
            BinaryOp::GtU32 => "mask_bits(bitcast<u32>(a) > bitcast<u32>(b))",
            BinaryOp::GeU32 => "mask_bits(bitcast<u32>(a) >= bitcast<u32>(b))",
            BinaryOp::ZeroWhereU32 => "bitcast<f32>(select(bitcast<u32>(a), 0u, bitcast<u32>(b) != 0u))",
            BinaryOp::OrU32 => "bitcast<f32>(bitcast<u32>(a) | bitcast<u32>(b))",
        }
    }

    /// The module of this op over `lhs` and `rhs` elements into `dst` ones.
    fn source(self, [lhs, rhs, dst]: [DType; 3]) -> String {
        BINARY.source(&[
            ("BINARY_EXPR", self.expr()),
            ("LHS_DTYPE_CODE", lhs.wgsl_code()),
            ("RHS_DTYPE_CODE", rhs.wgsl_code()),
            ("DST_DTYPE_CODE", dst.wgsl_code()),
        ])
    }

    /// The dtypes of the op's operands `a` and `b` and of its output (F32 operands take any
    /// float dtype).
    fn dtypes(self) -> [DType; 3] {
        match self {
            BinaryOp::MaskedFill => [DType::F32, DType::U32, DType::F32],
            BinaryOp::Eq
            | BinaryOp::Ne
            | BinaryOp::Lt
            | BinaryOp::Le
            | BinaryOp::Gt
            | BinaryOp::Ge => [DType::F32, DType::F32, DType::U32],
            BinaryOp::EqU32
            | BinaryOp::NeU32
            | BinaryOp::LtU32
            | BinaryOp::LeU32
            | BinaryOp::GtU32
            | BinaryOp::GeU32
            | BinaryOp::ZeroWhereU32
            | BinaryOp::OrU32 => [DType::U32; 3],
            _ => [DType::F32; 3],
        }
    }

    /// Names the op's specialisation in pipeline keys: its name, but for the u32 ops, which
    /// share their names with the f32 ones in errors.
    fn variant(self) -> &'static str {
        match self {
            BinaryOp::EqU32 => "eq_u32",
            BinaryOp::NeU32 => "ne_u32",
            BinaryOp::LtU32 => "lt_u32",
            BinaryOp::LeU32 => "le_u32",
            BinaryOp::GtU32 => "gt_u32",
            BinaryOp::GeU32 => "ge_u32",
            BinaryOp::ZeroWhereU32 => "zero_where_u32",
            BinaryOp::OrU32 => "or_u32",
            _ => self.name(),
        }
    }

    /// The comparison of u32 values that this f32 comparison stands for.
    fn on_u32(self) -> BinaryOp {
        match self {
            BinaryOp::Eq => BinaryOp::EqU32,
            BinaryOp::Ne => BinaryOp::NeU32,
            BinaryOp::Lt => BinaryOp::LtU32,
            BinaryOp::Le => BinaryOp::LeU32,
            BinaryOp::Gt => BinaryOp::GtU32,
            BinaryOp::Ge => BinaryOp::GeU32,
            other => other,
        }
    }
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = BinaryOp::ALL
        .iter()
        .map(|op| (format!("binary/{}", op.variant()), op.source(op.dtypes())))
        .collect();
    for (op, dtypes) in [
        (BinaryOp::Add, [DType::F16, DType::F16, DType::F16]),
        (BinaryOp::Mul, [DType::F32, DType::BF16, DType::F32]),
        (BinaryOp::MaskedFill, [DType::BF16, DType::U32, DType::BF16]),
        (BinaryOp::Lt, [DType::F16, DType::F16, DType::U32]),
    ] {
        let name = format!("binary/{}_{dtypes:?}", op.variant());
        all.push((name, op.source(dtypes)));
    }
    all
}

/// How `layout` (an operand expanded to the output's shape) reads a dense run: `(stretch,
/// period)` when its trailing dims are broadcast (together `stretch` elements), the dims before
/// them a dense run of `period` elements, and the rest broadcast (repeats of the run). A
/// contiguous operand is `(1, its size)`; a bias row `(1, row)`; a channel bias over
/// `[N, C, H, W]` `(H W, C)`. `None` otherwise.
fn broadcast_run(layout: &Layout) -> Option<(usize, usize)> {
    let (shape, strides) = (&layout.shape, &layout.strides);
    let mut d = shape.len();
    let mut stretch = 1;
    while d > 0 && (shape[d - 1] == 1 || strides[d - 1] == 0) {
        stretch *= shape[d - 1];
        d -= 1;
    }
    let mut period = 1;
    while d > 0 && (shape[d - 1] == 1 || strides[d - 1] == period) {
        period *= shape[d - 1];
        d -= 1;
    }
    let leading_repeat = (0..d).all(|i| shape[i] == 1 || strides[i] == 0);
    leading_repeat.then_some((stretch.max(1), period.max(1)))
}

/// `a op b` broadcast to their common shape, into a new contiguous tensor.
pub(crate) fn binary(a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    binary_with(a, b, op, 0.0)
}

/// As [`binary`], for the ops that read a scalar (masked_fill's value, leaky_relu's slope).
/// `b` is a u32 mask for `MaskedFill`, else f32.
pub(crate) fn binary_with(a: &Tensor, b: &Tensor, op: BinaryOp, scalar: f32) -> Result<Tensor> {
    let name = op.name();
    a.expect_same_device(name, b)?;
    // 16-bit operands are read as they are, and a float result takes their dtype (F32 for two
    // float dtypes under autocast).
    let [a_dtype, b_dtype, mut out_dtype] = op.dtypes();
    let floats: Vec<&Tensor> = [(a, a_dtype), (b, b_dtype)]
        .into_iter()
        .filter(|(_, want)| *want == DType::F32)
        .map(|(t, _)| t)
        .collect();
    if let Some(dtype) = cast::result_dtype(name, &floats)? {
        if a.exceeds_binding() || b.exceeds_binding() {
            // Windows of a tensor past one binding are read as F32 copies.
            let (dtype, wide) = cast::widened(name, &[a, b])?.expect("a 16-bit operand");
            return cast::narrowed(binary_with(&wide[0], &wide[1], op, scalar)?, dtype);
        }
        if out_dtype == DType::F32 {
            out_dtype = dtype;
        }
    }
    for (t, want) in [(a, a_dtype), (b, b_dtype)] {
        if !(want == DType::F32 && t.dtype().is_float()) {
            t.expect_dtype(name, want)?;
        }
    }
    let shape = broadcast_shapes(a.shape(), b.shape()).ok_or_else(|| Error::Shape {
        op: name,
        msg: format!(
            "shapes {:?} and {:?} do not broadcast",
            a.shape(),
            b.shape()
        ),
    })?;
    let out = Tensor::empty(name, &shape, out_dtype, a.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    if out.exceeds_binding() || a.exceeds_binding() || b.exceeds_binding() {
        launch_binary_windows(op, a, b, &out, scalar)?;
        return Ok(out);
    }
    let (a, b) = (readable_operand(a, &shape)?, readable_operand(b, &shape)?);
    launch_binary(op, &a, &b, &out, scalar)?;
    Ok(out)
}

/// [`binary_with`]'s launches where a tensor is past one binding: a launch per window of the
/// flat output. An operand dense at the output's shape is windowed with it; any other (a bias,
/// BatchNorm's per-channel statistics, a strided view) is first copied dense at the output's
/// shape (the copy windows it). A broadcast operand past the limit is a `TooLarge` error.
fn launch_binary_windows(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    out: &Tensor,
    scalar: f32,
) -> Result<()> {
    let name = op.name();
    let dense_at_output = |t: &Tensor| -> Result<Tensor> {
        if t.shape() == out.shape() && t.is_contiguous() {
            return Ok(t.clone());
        }
        if t.exceeds_binding() && t.shape() != out.shape() {
            return Err(too_large_view(name, t));
        }
        // A strided view at the output's shape (the grad of a padded image's interior) is
        // copied a run of slices at a time.
        t.detach().expand(out.shape())?.contiguous()
    };
    let (a, b) = (dense_at_output(a)?, dense_at_output(b)?);
    for (start, len) in windows(out.device(), out.numel()) {
        let (aw, bw) = (a.window(start, len), b.window(start, len));
        launch_binary(op, &aw, &bw, &out.window(start, len), scalar)?;
    }
    Ok(())
}

/// `t` as the binary kernels read it at the output's `shape`: itself where it is dense or a
/// dense run repeated ([`broadcast_run`]), else a dense copy at that shape (a transposed view,
/// a broadcast the runs do not cover). The copy kernel walks a layout like an odometer, with no
/// division per element; a kernel that split every output index into coordinates for each
/// operand ran 17x slower than over dense operands on lavapipe (adding a transposed view of
/// 1.6M elements: 32.6 ms, against 4.9 ms for the copy and 1.9 ms for the add). Detached, so
/// the copy adds no graph node of its own.
fn readable_operand(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if broadcast_run(&t.layout().expand("binary", shape)?).is_some() {
        return Ok(t.clone());
    }
    t.detach().expand(shape)?.contiguous()
}

/// Runs `op` over `a` and `b` (broadcast to `out`'s shape, each dense or a dense run repeated:
/// see [`readable_operand`]) into the contiguous `out`.
fn launch_binary(op: BinaryOp, a: &Tensor, b: &Tensor, out: &Tensor, scalar: f32) -> Result<()> {
    let name = op.name();
    let shape = out.shape().to_vec();
    let n = out.numel();
    let la = a.layout().expand(name, &shape)?;
    let lb = b.layout().expand(name, &shape)?;
    // Dense operands take `contiguous`; dense runs held and repeated (a bias added to each
    // row or to each channel) take `repeated`.
    let run = |l: &Layout| broadcast_run(l).expect("operands are dense runs (readable_operand)");
    let ((stretch_a, period_a), (stretch_b, period_b)) = (run(&la), run(&lb));
    // Four elements per load where lengths, offsets and runs allow (about twice the
    // bandwidth on CPU adapters), by an entry of its own.
    let in_fours = |offset: usize, stretch: usize, period: usize| {
        (stretch == 1 && offset.is_multiple_of(4) && period.is_multiple_of(4))
            || stretch.is_multiple_of(4)
    };
    let vec4 = n.is_multiple_of(4)
        && in_fours(la.offset, stretch_a, period_a)
        && in_fours(lb.offset, stretch_b, period_b);
    let repeated = (stretch_a, period_a) != (1, n) || (stretch_b, period_b) != (1, n);
    let entry = match (repeated, vec4) {
        (false, true) => "contiguous_vec4",
        (false, false) => "contiguous",
        (true, true) => "repeated_vec4",
        (true, false) => "repeated",
    };
    let params = BinaryParams {
        n: n as u32,
        lhs_offset: la.offset as u32,
        rhs_offset: lb.offset as u32,
        lhs_period: period_a as u32,
        rhs_period: period_b as u32,
        lhs_stretch: stretch_a as u32,
        rhs_stretch: stretch_b as u32,
        scalar,
    };
    let dtypes = [a.dtype(), b.dtype(), out.dtype()];
    let source = || op.source(dtypes);
    if dtypes.iter().any(|d| d.is_16_bit()) {
        // Read or written as 16-bit elements: a module of its own, which a captured step
        // runs as it is (the fuser's elementwise kernels read and write 32-bit elements).
        let variant = format!("{}_{dtypes:?}", op.variant());
        let [lhs, rhs, dst] = dtypes;
        let kernel = Kernel::specialised(&BINARY, entry, &variant, &source).with_dtypes(&[
            (1, lhs),
            (2, rhs),
            (3, dst),
        ]);
        let bound = [(1, a), (2, b), (3, out)];
        return Launch::new(name, &kernel, &bound, &params).record(groups(n, CONTIGUOUS_PER_GROUP));
    }
    let kernel = Kernel::specialised(&BINARY, entry, op.variant(), &source);
    let describe = || Elementwise {
        params: "a: f32, b: f32, s: f32",
        expr: op.expr().to_string(),
        scalars: vec![scalar],
        operands: vec![(1, la.clone()), (2, lb.clone())],
        output: 3,
        shape: shape.clone(),
    };
    Launch::new(name, &kernel, &[(1, a), (2, b), (3, out)], &params)
        .fusible(|| Fusion::Elementwise(describe()))
        .record(groups(n, CONTIGUOUS_PER_GROUP))
}

/// `grad` summed over the dims along which an input of `shape` was broadcast, so that it has
/// that input's shape.
pub(crate) fn sum_to_shape(grad: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if grad.shape() == shape {
        return Ok(grad.clone());
    }
    let lead = grad.rank() - shape.len();
    let dims: Vec<usize> = (0..grad.rank())
        .filter(|&d| d < lead || (shape[d - lead] == 1 && grad.shape()[d] != 1))
        .collect();
    grad.sum_dims(&dims, true)?.reshape(shape)
}

/// Records a broadcasting binary op whose input grads are `rule(g, a, b)`, each summed back
/// to its input's shape.
fn record_binary(
    name: &'static str,
    out: Tensor,
    a: &Tensor,
    b: &Tensor,
    rule: fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>,
) -> Tensor {
    record(name, out, &[a, b], |_| {
        let (a, b) = (a.detach(), b.detach());
        move |g: &Tensor| {
            let (ga, gb) = rule(g, &a, &b)?;
            Ok(vec![
                Some(sum_to_shape(&ga, a.shape())?),
                Some(sum_to_shape(&gb, b.shape())?),
            ])
        }
    })
}

/// Records `a + b` or `a - b` (`negate_b`): their grads need only the operands' shapes, so
/// unlike [`record_binary`] the node keeps neither operand alive (a residual stream's adds
/// would otherwise hold every block's branch output until backward, as torch's do not).
fn record_sum(name: &'static str, out: Tensor, a: &Tensor, b: &Tensor, negate_b: bool) -> Tensor {
    record(name, out, &[a, b], |_| {
        let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
        move |g: &Tensor| {
            let gb = match negate_b {
                true => g.neg()?,
                false => g.clone(),
            };
            Ok(vec![
                Some(sum_to_shape(g, &a_shape)?),
                Some(sum_to_shape(&gb, &b_shape)?),
            ])
        }
    })
}

impl Tensor {
    /// `self + other`, broadcast.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary(self, other, BinaryOp::Add)?;
        Ok(record_sum("add", out, self, other, false))
    }

    /// `self - other`, broadcast.
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary(self, other, BinaryOp::Sub)?;
        Ok(record_sum("sub", out, self, other, true))
    }

    /// `self * other`, broadcast.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary(self, other, BinaryOp::Mul)?;
        Ok(record_binary("mul", out, self, other, |g, a, b| {
            Ok((g.mul(b)?, g.mul(a)?))
        }))
    }

    /// `self / other`, broadcast.
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary(self, other, BinaryOp::Div)?;
        Ok(record_binary("div", out, self, other, |g, a, b| {
            // d/db (a / b) = -a / b^2
            Ok((g.div(b)?, g.mul(a)?.div(&b.mul(b)?)?.neg()?))
        }))
    }

    /// Elementwise maximum, broadcast. Where both are equal, each gets half the grad.
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary(self, other, BinaryOp::Maximum)?;
        Ok(record_binary("maximum", out, self, other, |g, a, b| {
            let share_a = binary(a, b, BinaryOp::MaximumShare)?;
            let share_b = binary(b, a, BinaryOp::MaximumShare)?;
            Ok((g.mul(&share_a)?, g.mul(&share_b)?))
        }))
    }
}

/// Comparisons, `minimum`, `pow` and `where_cond`: the ops of masks and selections.
impl Tensor {
    /// Elementwise minimum, broadcast; NaN where either is NaN. Where both are equal, each
    /// gets half the grad (as `maximum`).
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary(self, other, BinaryOp::Minimum)?;
        Ok(record_binary("minimum", out, self, other, |g, a, b| {
            // a's share of the grad is where b is the larger: maximum's share, swapped.
            let share_a = binary(b, a, BinaryOp::MaximumShare)?;
            let share_b = binary(a, b, BinaryOp::MaximumShare)?;
            Ok((g.mul(&share_a)?, g.mul(&share_b)?))
        }))
    }

    /// `self^exponent` elementwise, broadcast, as torch's `pow` with a tensor exponent:
    /// negative bases with integral exponents keep their sign, `0^0 = 1`. The base's grad is
    /// `b a^(b - 1)`, 0 where `b` is 0 (at `0^0` too); the exponent's is `a^b log(a)`, 0 where
    /// `a` is 0 and `b >= 0`: torch's rules.
    pub fn pow(&self, exponent: &Tensor) -> Result<Tensor> {
        let out = binary(self, exponent, BinaryOp::Pow)?;
        Ok(record("pow", out, &[self, exponent], |out| {
            let (a, b, y) = (self.detach(), exponent.detach(), out.detach());
            move |g: &Tensor| {
                // d/da a^b = b a^(b - 1), 0 where b = 0 (not 0 * inf at a = 0);
                // d/db a^b = a^b log(a)
                let da = b.mul(&a.pow(&b.sub_scalar(1.0)?)?)?;
                let ga = g.mul(&da.masked_fill(&b.eq_scalar(0.0)?, 0.0)?)?;
                let gb = g.mul(&y.mul(&binary(&a, &b, BinaryOp::PowLogBase)?)?)?;
                Ok(vec![
                    Some(sum_to_shape(&ga, a.shape())?),
                    Some(sum_to_shape(&gb, b.shape())?),
                ])
            }
        }))
    }

    /// `self == other` elementwise, broadcast: a u32 mask of 0/1 (NaN equals nothing).
    pub fn eq(&self, other: &Tensor) -> Result<Tensor> {
        compare(self, other, BinaryOp::Eq)
    }

    /// `self != other` elementwise, broadcast: a u32 mask of 0/1.
    pub fn ne(&self, other: &Tensor) -> Result<Tensor> {
        compare(self, other, BinaryOp::Ne)
    }

    /// `self < other` elementwise, broadcast: a u32 mask of 0/1.
    pub fn lt(&self, other: &Tensor) -> Result<Tensor> {
        compare(self, other, BinaryOp::Lt)
    }

    /// `self <= other` elementwise, broadcast: a u32 mask of 0/1.
    pub fn le(&self, other: &Tensor) -> Result<Tensor> {
        compare(self, other, BinaryOp::Le)
    }

    /// `self > other` elementwise, broadcast: a u32 mask of 0/1.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::from_vec(vec![1.0, -2.0, 3.0], &[3], &dev)?;
    /// let positive = x.gt(&Tensor::zeros(&[1], &dev)?)?;
    /// let y = positive.where_cond(&x, &x.neg()?)?; // |x|
    /// assert_eq!(y.to_vec()?, vec![1.0, 2.0, 3.0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn gt(&self, other: &Tensor) -> Result<Tensor> {
        compare(self, other, BinaryOp::Gt)
    }

    /// `self >= other` elementwise, broadcast: a u32 mask of 0/1.
    pub fn ge(&self, other: &Tensor) -> Result<Tensor> {
        compare(self, other, BinaryOp::Ge)
    }

    /// `a` where this u32 mask is nonzero, else `b`, all three broadcast together, as
    /// torch's `where(mask, a, b)`. Grads reach `a` where the mask is set and `b` where it is
    /// not; a NaN or inf in the branch not taken does not leak into the value or the grads.
    pub fn where_cond(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "where_cond";
        self.expect_dtype(OP, DType::U32)?;
        let shape = broadcast_shapes(self.shape(), a.shape())
            .and_then(|s| broadcast_shapes(&s, b.shape()))
            .ok_or_else(|| Error::Shape {
                op: OP,
                msg: format!(
                    "mask {:?}, a {:?} and b {:?} do not broadcast",
                    self.shape(),
                    a.shape(),
                    b.shape()
                ),
            })?;
        let unset = crate::ops::unary::mask_not(self)?;
        if a.dtype() == DType::U32 || b.dtype() == DType::U32 {
            // u32 values (labels, token ids): each branch not taken zeroed, then the two
            // or-ed, bit for bit. The result keeps what both branches' index ranges allow.
            for t in [a, b] {
                t.expect_dtype(OP, DType::U32)?;
            }
            let a_taken = binary(&a.expand(&shape)?, &unset, BinaryOp::ZeroWhereU32)?;
            let b_taken = binary(&b.expand(&shape)?, self, BinaryOp::ZeroWhereU32)?;
            let range = a
                .index_range()
                .zip(b.index_range())
                .map(|(x, y)| x.union(y));
            return Ok(binary(&a_taken, &b_taken, BinaryOp::OrU32)?.with_index_range(range));
        }
        // Two masked fills and an add: elementwise, so a captured step fuses them into one
        // kernel. Each fill replaces the branch not taken (NaN included) with 0.
        let taken_a = a.expand(&shape)?.masked_fill(&unset, 0.0)?;
        let taken_b = b.expand(&shape)?.masked_fill(self, 0.0)?;
        taken_a.add(&taken_b)
    }
}

/// A broadcasting comparison: a u32 mask (bound 2, so it may index) that records no grad.
/// Two u32 tensors compare their values (predicted classes with labels); a u32 tensor with
/// a float one is an error, as the f32 comparison is exact only below 2^24.
fn compare(a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    let op = match (a.dtype(), b.dtype()) {
        (DType::U32, DType::U32) => op.on_u32(),
        (DType::U32, _) | (_, DType::U32) => {
            return Err(Error::InvalidArgument {
                op: op.name(),
                msg: format!(
                    "compares two u32 tensors or two float tensors, got {:?} {:?} and {:?} {:?} \
                     (convert one with to_dtype, or compare u32 values with a `_scalar` op)",
                    a.dtype(),
                    a.shape(),
                    b.dtype(),
                    b.shape()
                ),
            })
        }
        _ => op,
    };
    Ok(binary(a, b, op)?.with_index_bound(Some(2)))
}

macro_rules! impl_std_op {
    ($trait:ident, $method:ident) => {
        impl std::ops::$trait<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$method(self, rhs)
            }
        }
    };
}

impl_std_op!(Add, add);
impl_std_op!(Sub, sub);
impl_std_op!(Mul, mul);
impl_std_op!(Div, div);

/// Masks and dropout: ops that combine a tensor with a mask.
impl Tensor {
    /// `value` where the u32 `mask` (broadcast to this tensor's shape) is nonzero, else
    /// this tensor's element. The grad passes where the mask is 0.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::zeros(&[2, 2], &dev)?;
    /// let causal = Tensor::triu_mask(2, 2, 1, &dev)?; // 1 above the diagonal
    /// let y = x.masked_fill(&causal, f32::NEG_INFINITY)?;
    /// assert_eq!(y.to_vec()?, vec![0.0, f32::NEG_INFINITY, 0.0, 0.0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn masked_fill(&self, mask: &Tensor, value: f32) -> Result<Tensor> {
        const OP: &str = "masked_fill";
        if broadcast_shapes(self.shape(), mask.shape()).as_deref() != Some(self.shape()) {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "mask of shape {:?} does not broadcast to the input's shape {:?}",
                    mask.shape(),
                    self.shape()
                ),
            });
        }
        let out = binary_with(self, mask, BinaryOp::MaskedFill, value)?;
        Ok(record(OP, out, &[self], |_| {
            let mask = mask.clone();
            move |g: &Tensor| {
                Ok(vec![Some(binary_with(
                    g,
                    &mask,
                    BinaryOp::MaskedFill,
                    0.0,
                )?)])
            }
        }))
    }

    /// The elements on and below diagonal `diagonal` of the last two dims
    /// (`j <= i + diagonal`); 0 elsewhere.
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        let (rows, cols) = self.last_two("tril")?;
        let above = Tensor::triu_mask(rows, cols, diagonal.saturating_add(1), self.device())?;
        self.masked_fill(&above, 0.0)
    }

    /// The elements on and above diagonal `diagonal` of the last two dims
    /// (`j >= i + diagonal`); 0 elsewhere.
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        let (rows, cols) = self.last_two("triu")?;
        let below = Tensor::tril_mask(rows, cols, diagonal.saturating_sub(1), self.device())?;
        self.masked_fill(&below, 0.0)
    }

    fn last_two(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape() {
            [.., rows, cols] => Ok((*rows, *cols)),
            _ => Err(Error::Shape {
                op,
                msg: format!("needs at least 2 dims, got shape {:?}", self.shape()),
            }),
        }
    }

    /// Zeroes each element with probability `p` and scales the rest by `1 / (1 - p)`, as
    /// PyTorch's `dropout` in training. The mask is drawn on the host from the global seed
    /// ([`crate::manual_seed`]), so runs repeat; the grad passes through the same mask. At
    /// `p` = 1 every element is dropped: the input times 0, as torch (NaN stays NaN).
    pub fn dropout(&self, p: f32) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "dropout",
                msg: format!("p must be in [0, 1], got {p}"),
            });
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        if p == 1.0 {
            return self.mul_scalar(0.0);
        }
        let keep = 1.0 / (1.0 - p);
        let numel = checked_host_numel("dropout", self.shape(), self.device())?;
        let dtype = self.dtype();
        // A fresh seed per call, drawn again at each replay of a captured step. An F32 mask
        // holds 0 or the scale; a 16-bit one holds 0 or 1 in the tensor's dtype (exact), and
        // the scale follows in f32, so the product is rounded once.
        let mask: HostBytes = Arc::new(move || {
            let kept = uniform_values(numel, next_seed())
                .into_iter()
                .map(|u| u >= p);
            match dtype {
                DType::F16 => kept
                    .flat_map(|k| half::f16::from_f32(k as u8 as f32).to_le_bytes())
                    .collect(),
                DType::BF16 => kept
                    .flat_map(|k| half::bf16::from_f32(k as u8 as f32).to_le_bytes())
                    .collect(),
                _ => kept
                    .flat_map(|k| if k { keep } else { 0.0 }.to_le_bytes())
                    .collect(),
            }
        });
        let mask = from_host_fn("dropout", mask, self.shape(), dtype, self.device())?;
        match dtype.is_16_bit() {
            true => self.mul(&mask)?.mul_scalar(keep),
            false => self.mul(&mask),
        }
    }
}

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}
