//! Elementwise unary ops and ops with a scalar operand. One WGSL template
//! (`shaders/unary.wgsl`) is specialised with each op's expression.

use crate::error::{Error, Result};
use crate::kernel::{
    groups, windows, Elementwise, Fusion, Kernel, KernelParams, Launch, ShaderFamily,
    CONTIGUOUS_PER_GROUP, ELEMENTWISE_STORES_WGSL, SIXTEEN_BIT_WGSL,
};
use crate::ops::binary::{binary, binary_with, BinaryOp};
use crate::ops::cast;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `n` elements from `offset`, by the entry `contiguous_vec4` or `contiguous`.
    pub(crate) struct UnaryParams {
        n: u32,
        offset: u32,
        scalar: f32,
        scalar2: f32,
    }
}

static UNARY: ShaderFamily = ShaderFamily {
    name: "unary",
    wgsl: include_str!("../../shaders/unary.wgsl"),
    params: &[&UnaryParams::LAYOUT],
    preludes: &[SIXTEEN_BIT_WGSL, ELEMENTWISE_STORES_WGSL],
};

/// The unary ops; each is one specialisation of the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnaryOp {
    Neg,
    Exp,
    Log,
    Relu,
    Tanh,
    Sigmoid,
    Gelu,
    /// GELU's tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    Sqrt,
    Powf,
    AddScalar,
    MulScalar,
    DivScalar,
    Abs,
    Sign,
    Erf,
    /// `x` limited to `[s, t]` (NaN stays NaN).
    Clamp,
    /// 1 where `s <= x <= t`, else 0: where clamp passes its grad.
    InRange,
    Sin,
    Cos,
    Rsqrt,
    Silu,
    Softplus,
    /// `x` where positive, else `s x`.
    LeakyRelu,
    /// Comparisons with the scalar: u32 masks of 0/1 (stored through the f32 binding as bits).
    EqScalar,
    NeScalar,
    LtScalar,
    LeScalar,
    GtScalar,
    GeScalar,
    /// Casts: f32 to u32 truncates toward zero (negatives and NaN to 0, saturating), u32 to
    /// f32 rounds.
    F32ToU32,
    U32ToF32,
    /// 1 where the u32 `x` is 0, else 0: a mask's complement.
    MaskNot,
}

impl UnaryOp {
    #[cfg(test)]
    const ALL: [UnaryOp; 33] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Relu,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Sqrt,
        UnaryOp::Powf,
        UnaryOp::AddScalar,
        UnaryOp::MulScalar,
        UnaryOp::DivScalar,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Erf,
        UnaryOp::Clamp,
        UnaryOp::InRange,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Rsqrt,
        UnaryOp::Silu,
        UnaryOp::Softplus,
        UnaryOp::LeakyRelu,
        UnaryOp::EqScalar,
        UnaryOp::NeScalar,
        UnaryOp::LtScalar,
        UnaryOp::LeScalar,
        UnaryOp::GtScalar,
        UnaryOp::GeScalar,
        UnaryOp::F32ToU32,
        UnaryOp::U32ToF32,
        UnaryOp::MaskNot,
    ];

    fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Relu => "relu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Powf => "powf",
            UnaryOp::AddScalar => "add_scalar",
            UnaryOp::MulScalar => "mul_scalar",
            UnaryOp::DivScalar => "div_scalar",
            UnaryOp::Abs => "abs",
            UnaryOp::Sign => "sign",
            UnaryOp::Erf => "erf",
            UnaryOp::Clamp => "clamp",
            UnaryOp::InRange => "in_range",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Silu => "silu",
            UnaryOp::Softplus => "softplus",
            UnaryOp::LeakyRelu => "leaky_relu",
            UnaryOp::EqScalar => "eq_scalar",
            UnaryOp::NeScalar => "ne_scalar",
            UnaryOp::LtScalar => "lt_scalar",
            UnaryOp::LeScalar => "le_scalar",
            UnaryOp::GtScalar => "gt_scalar",
            UnaryOp::GeScalar => "ge_scalar",
            UnaryOp::F32ToU32 => "to_dtype_u32",
            UnaryOp::U32ToF32 => "to_dtype_f32",
            UnaryOp::MaskNot => "mask_not",
        }
    }

    /// The dtypes of the op's input and output.
    fn dtypes(self) -> (DType, DType) {
        match self {
            UnaryOp::EqScalar
            | UnaryOp::NeScalar
            | UnaryOp::LtScalar
            | UnaryOp::LeScalar
            | UnaryOp::GtScalar
            | UnaryOp::GeScalar
            | UnaryOp::F32ToU32 => (DType::F32, DType::U32),
            UnaryOp::U32ToF32 => (DType::U32, DType::F32),
            UnaryOp::MaskNot => (DType::U32, DType::U32),
            _ => (DType::F32, DType::F32),
        }
    }

    /// The WGSL expression in `x` (the element) and `s` (the scalar).
    fn expr(self) -> &'static str {
        match self {
            UnaryOp::Neg => "-x",
            UnaryOp::Exp => "exp(x)",
            UnaryOp::Log => "log(x)",
            // NaN stays NaN, as in PyTorch.
            UnaryOp::Relu => "select(max(x, 0.0), x, is_nan(x))",
            // Clamped: some drivers compute tanh through exp and overflow to NaN.
            UnaryOp::Tanh => "select(tanh(clamp(x, -20.0, 20.0)), x, is_nan(x))",
            UnaryOp::Sigmoid => "1.0 / (1.0 + exp(-x))",
            UnaryOp::Gelu => "0.5 * x * (1.0 + erf_approx(x * 0.7071067811865476))",
            // tanh clamped as for Tanh; NaN stays NaN through the product.
            UnaryOp::GeluTanh => {
                "0.5 * x * (1.0 + tanh(clamp(0.7978845608028654 * (x + 0.044715 * x * x * x), -20.0, 20.0)))"
            }
            UnaryOp::Sqrt => "sqrt(x)",
            UnaryOp::Powf => "pow_exact(x, s)",
            UnaryOp::AddScalar => "x + s",
            UnaryOp::MulScalar => "x * s",
            UnaryOp::DivScalar => "x / s",
            UnaryOp::Abs => "abs(x)",
            // NaN stays NaN, as torch (WGSL's sign of NaN is 0 on some drivers).
            UnaryOp::Sign => "select(sign(x), x, is_nan(x))",
            UnaryOp::Erf => "erf_approx(x)",
            UnaryOp::Clamp => "select(clamp(x, s, t), x, is_nan(x))",
            UnaryOp::InRange => "select(0.0, 1.0, x >= s && x <= t)",
            UnaryOp::Sin => "sin(x)",
            UnaryOp::Cos => "cos(x)",
            // Not inverseSqrt: WGSL leaves its value at 0 to the driver (torch: inf).
            UnaryOp::Rsqrt => "1.0 / sqrt(x)",
            UnaryOp::Silu => "x / (1.0 + exp(-x))",
            // torch's softplus (beta 1, threshold 20): x past the threshold, else a form that
            // neither overflows for large x nor loses small values.
            UnaryOp::Softplus => "select(max(x, 0.0) + log(1.0 + exp(-abs(x))), x, x > 20.0)",
            UnaryOp::LeakyRelu => "select(x * s, x, x > 0.0)",
            UnaryOp::EqScalar => "mask_bits(x == s)",
            UnaryOp::NeScalar => "mask_bits(x != s || is_nan(x) || is_nan(s))",
            UnaryOp::LtScalar => "mask_bits(x < s)",
            UnaryOp::LeScalar => "mask_bits(x <= s)",
            UnaryOp::GtScalar => "mask_bits(x > s)",
            UnaryOp::GeScalar => "mask_bits(x >= s)",
            // Clamped before converting: GLSL leaves out-of-range conversions undefined.
            UnaryOp::F32ToU32 => {
                "bitcast<f32>(u32(clamp(select(trunc(x), 0.0, is_nan(x)), 0.0, 4294967040.0)))"
            }
            UnaryOp::U32ToF32 => "f32(bitcast<u32>(x))",
            UnaryOp::MaskNot => "mask_bits(bitcast<u32>(x) == 0u)",
        }
    }

    /// The module of this op reading `src` elements and writing `dst` ones.
    fn source(self, src: DType, dst: DType) -> String {
        UNARY.source(&[
            ("UNARY_EXPR", self.expr()),
            ("SRC_DTYPE_CODE", src.wgsl_code()),
            ("DST_DTYPE_CODE", dst.wgsl_code()),
        ])
    }
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = UnaryOp::ALL
        .iter()
        .map(|op| {
            let (src, dst) = op.dtypes();
            (format!("unary/{}", op.name()), op.source(src, dst))
        })
        .collect();
    for (op, src, dst) in [
        (UnaryOp::Gelu, DType::F16, DType::F16),
        (UnaryOp::Exp, DType::BF16, DType::BF16),
        (UnaryOp::GtScalar, DType::BF16, DType::U32),
    ] {
        let name = format!("unary/{}_{src:?}_to_{dst:?}", op.name());
        all.push((name, op.source(src, dst)));
    }
    all
}

/// Runs `op` over every element of `x` into a new contiguous tensor.
pub(crate) fn unary(x: &Tensor, op: UnaryOp, scalar: f32) -> Result<Tensor> {
    unary_with(x, op, scalar, 0.0)
}

/// As [`unary`], for the ops with a second scalar `t` (clamp's upper bound).
fn unary_with(x: &Tensor, op: UnaryOp, scalar: f32, scalar2: f32) -> Result<Tensor> {
    let name = op.name();
    let (in_dtype, mut out_dtype) = op.dtypes();
    if x.dtype().is_16_bit() && in_dtype == DType::F32 {
        // A 16-bit input is read as it is; a float result keeps its dtype.
        if x.exceeds_binding() {
            // Windows of a tensor past one binding are read as F32 copies.
            let (dtype, wide) = cast::widened(name, &[x])?.expect("a 16-bit input");
            return cast::narrowed(unary_with(&wide[0], op, scalar, scalar2)?, dtype);
        }
        if out_dtype == DType::F32 {
            out_dtype = x.dtype();
        }
    } else {
        x.expect_dtype(name, in_dtype)?;
    }
    let out = Tensor::empty(name, x.shape(), out_dtype, x.device())?;
    if x.numel() == 0 {
        return Ok(out);
    }
    if out.exceeds_binding() || x.exceeds_binding() {
        // Past one binding: a launch per window of a dense input and of the output. A view
        // (a reduction's grad broadcast back, a transpose) is first copied dense: the copy
        // windows it.
        let x = &match x.is_contiguous() {
            true => x.clone(),
            false => x.detach().contiguous()?,
        };
        for (start, len) in windows(x.device(), x.numel()) {
            launch_unary(
                op,
                &x.window(start, len),
                &out.window(start, len),
                scalar,
                scalar2,
            )?;
        }
        return Ok(out);
    }
    // A view is read through a dense copy: the copy kernel walks a layout like an odometer,
    // with no division per element, where a kernel that split every index into coordinates
    // ran 9-13x slower than over dense input on lavapipe (a transposed relu of 1.6M
    // elements: 19.6 ms, against 4.9 ms for the copy and 1.5 ms for the relu). Detached, so
    // the copy adds no graph node of its own; a dense input is read as it is.
    let dense = match x.is_contiguous() {
        true => x.clone(),
        false => x.detach().contiguous()?,
    };
    launch_unary(op, &dense, &out, scalar, scalar2)?;
    Ok(out)
}

/// Runs `op` over the contiguous `x` into the contiguous `out` (offset 0, as many elements).
fn launch_unary(op: UnaryOp, x: &Tensor, out: &Tensor, scalar: f32, scalar2: f32) -> Result<()> {
    let name = op.name();
    let n = x.numel();
    let layout = x.layout();
    debug_assert!(x.is_contiguous(), "{name} reads dense input");
    // Four elements per load where lengths and offsets allow (about twice the bandwidth on
    // CPU adapters), by an entry of its own.
    let vec4 = [n, layout.offset].iter().all(|x| x.is_multiple_of(4));
    let entry = if vec4 {
        "contiguous_vec4"
    } else {
        "contiguous"
    };
    let params = UnaryParams {
        n: n as u32,
        offset: layout.offset as u32,
        scalar,
        scalar2,
    };
    let (src, dst) = (x.dtype(), out.dtype());
    let source = || op.source(src, dst);
    if src.is_16_bit() || dst.is_16_bit() {
        // Read or written as 16-bit elements: a module of its own, which a captured step
        // runs as it is (the fuser's elementwise kernels read and write 32-bit elements).
        let variant = format!("{name}_{src:?}_to_{dst:?}");
        let kernel = Kernel::specialised(&UNARY, entry, &variant, &source)
            .with_dtypes(&[(1, src), (2, dst)]);
        let bound = [(1, x), (2, out)];
        return Launch::new(name, &kernel, &bound, &params).record(groups(n, CONTIGUOUS_PER_GROUP));
    }
    let kernel = Kernel::specialised(&UNARY, entry, name, &source);
    let describe = || Elementwise {
        params: "x: f32, s: f32, t: f32",
        expr: op.expr().to_string(),
        scalars: vec![scalar, scalar2],
        operands: vec![(1, layout.clone())],
        output: 2,
        shape: x.shape().to_vec(),
    };
    Launch::new(name, &kernel, &[(1, x), (2, out)], &params)
        .fusible(|| Fusion::Elementwise(describe()))
        .record(groups(n, CONTIGUOUS_PER_GROUP))
}

/// Records a unary op whose input grad is `rule(g, saved)`, where `saved` is the op's input
/// (`SavedInput`) or its output (`SavedOutput`).
fn record_unary(
    name: &'static str,
    out: Tensor,
    x: &Tensor,
    saved: Saved,
    rule: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Tensor {
    record(name, out, &[x], |out| {
        let kept = match saved {
            Saved::Input => x.detach(),
            Saved::Output => out.detach(),
        };
        move |g: &Tensor| Ok(vec![Some(rule(g, &kept)?)])
    })
}

/// Records a unary op whose input grad depends on the incoming grad alone.
fn record_grad_only(
    name: &'static str,
    out: Tensor,
    x: &Tensor,
    rule: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Tensor {
    record(name, out, &[x], |_| {
        move |g: &Tensor| Ok(vec![Some(rule(g)?)])
    })
}

/// Which tensor a unary backward rule needs.
#[derive(Clone, Copy)]
enum Saved {
    Input,
    Output,
}

impl Tensor {
    /// `-x`.
    pub fn neg(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Neg, 0.0)?;
        Ok(record_grad_only("neg", out, self, |g| g.neg()))
    }

    /// `e^x`.
    pub fn exp(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Exp, 0.0)?;
        Ok(record_unary("exp", out, self, Saved::Output, |g, y| {
            g.mul(y)
        }))
    }

    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Log, 0.0)?;
        Ok(record_unary("log", out, self, Saved::Input, |g, x| {
            g.div(x)
        }))
    }

    /// `max(x, 0)`.
    pub fn relu(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Relu, 0.0)?;
        Ok(record_unary("relu", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::ReluBackward)
        }))
    }

    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Tanh, 0.0)?;
        Ok(record_unary("tanh", out, self, Saved::Output, |g, y| {
            binary(g, y, BinaryOp::TanhBackward)
        }))
    }

    /// `1 / (1 + e^-x)`.
    pub fn sigmoid(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Sigmoid, 0.0)?;
        Ok(record_unary("sigmoid", out, self, Saved::Output, |g, y| {
            binary(g, y, BinaryOp::SigmoidBackward)
        }))
    }

    /// GELU with the exact (erf) form, as PyTorch's default.
    pub fn gelu(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Gelu, 0.0)?;
        Ok(record_unary("gelu", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::GeluBackward)
        }))
    }

    /// GELU with the tanh approximation, `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`:
    /// PyTorch's `gelu(x, approximate="tanh")`, GPT-2's `gelu_new`.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::GeluTanh, 0.0)?;
        Ok(record_unary(
            "gelu_tanh",
            out,
            self,
            Saved::Input,
            |g, x| binary(g, x, BinaryOp::GeluTanhBackward),
        ))
    }

    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Sqrt, 0.0)?;
        Ok(record_unary("sqrt", out, self, Saved::Output, |g, y| {
            binary(g, y, BinaryOp::SqrtBackward)
        }))
    }

    /// `x^p` elementwise (negative bases allowed for integral `p`).
    pub fn powf(&self, p: f32) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Powf, p)?;
        Ok(record_unary(
            "powf",
            out,
            self,
            Saved::Input,
            move |g, x| {
                if p == 0.0 {
                    return Tensor::zeros(x.shape(), x.device());
                }
                // d/dx x^p = p x^(p-1)
                g.mul(&x.powf(p - 1.0)?.mul_scalar(p)?)
            },
        ))
    }

    /// `x + s`.
    pub fn add_scalar(&self, s: f32) -> Result<Tensor> {
        let out = unary(self, UnaryOp::AddScalar, s)?;
        Ok(record_grad_only("add_scalar", out, self, |g| Ok(g.clone())))
    }

    /// `x - s`.
    pub fn sub_scalar(&self, s: f32) -> Result<Tensor> {
        let out = unary(self, UnaryOp::AddScalar, -s)?;
        Ok(record_grad_only("sub_scalar", out, self, |g| Ok(g.clone())))
    }

    /// `x * s`.
    pub fn mul_scalar(&self, s: f32) -> Result<Tensor> {
        let out = unary(self, UnaryOp::MulScalar, s)?;
        Ok(record_grad_only("mul_scalar", out, self, move |g| {
            g.mul_scalar(s)
        }))
    }

    /// `x / s`.
    pub fn div_scalar(&self, s: f32) -> Result<Tensor> {
        let out = unary(self, UnaryOp::DivScalar, s)?;
        Ok(record_grad_only("div_scalar", out, self, move |g| {
            g.div_scalar(s)
        }))
    }

    /// `|x|`; its grad is `sign(x)` (0 at 0, as PyTorch).
    pub fn abs(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Abs, 0.0)?;
        Ok(record_unary("abs", out, self, Saved::Input, |g, x| {
            g.mul(&x.sign()?)
        }))
    }

    /// -1, 0 or 1 by the sign of each element; its grad is 0.
    pub fn sign(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Sign, 0.0)?;
        Ok(record_grad_only("sign", out, self, |g| g.mul_scalar(0.0)))
    }

    /// The error function (absolute error below 1.5e-7).
    pub fn erf(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Erf, 0.0)?;
        Ok(record_unary("erf", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::ErfBackward)
        }))
    }

    /// Each element limited to `[min, max]`; NaN stays NaN. The grad passes where
    /// `min <= x <= max`, as PyTorch's `clamp`.
    pub fn clamp(&self, min: f32, max: f32) -> Result<Tensor> {
        if min.is_nan() || max.is_nan() || min > max {
            return Err(crate::error::Error::InvalidArgument {
                op: "clamp",
                msg: format!("needs min <= max, got min {min} and max {max}"),
            });
        }
        let out = unary_with(self, UnaryOp::Clamp, min, max)?;
        Ok(record_unary(
            "clamp",
            out,
            self,
            Saved::Input,
            move |g, x| g.mul(&unary_with(x, UnaryOp::InRange, min, max)?),
        ))
    }

    /// Sine.
    pub fn sin(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Sin, 0.0)?;
        Ok(record_unary("sin", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::SinBackward)
        }))
    }

    /// Cosine.
    pub fn cos(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Cos, 0.0)?;
        Ok(record_unary("cos", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::CosBackward)
        }))
    }

    /// `1 / sqrt(x)` (inf at 0, as torch).
    pub fn rsqrt(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Rsqrt, 0.0)?;
        Ok(record_unary("rsqrt", out, self, Saved::Output, |g, y| {
            binary(g, y, BinaryOp::RsqrtBackward)
        }))
    }

    /// `x * sigmoid(x)` (SiLU, "swish"): one kernel forward and one backward.
    pub fn silu(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Silu, 0.0)?;
        Ok(record_unary("silu", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::SiluBackward)
        }))
    }

    /// `log(1 + e^x)`, as torch's `softplus` with beta 1 and threshold 20 (`x` above it).
    pub fn softplus(&self) -> Result<Tensor> {
        let out = unary(self, UnaryOp::Softplus, 0.0)?;
        Ok(record_unary("softplus", out, self, Saved::Input, |g, x| {
            binary(g, x, BinaryOp::SoftplusBackward)
        }))
    }

    /// `x` where positive, else `negative_slope * x`; the grad at 0 is `negative_slope`, as
    /// torch.
    pub fn leaky_relu(&self, negative_slope: f32) -> Result<Tensor> {
        let out = unary(self, UnaryOp::LeakyRelu, negative_slope)?;
        Ok(record_unary(
            "leaky_relu",
            out,
            self,
            Saved::Input,
            move |g, x| binary_with(g, x, BinaryOp::LeakyReluBackward, negative_slope),
        ))
    }

    /// The tensor as `dtype`: f32 to u32 truncates toward zero (negatives and NaN become 0,
    /// values past the largest u32 an f32 holds become that, 4,294,967,040, as WGSL
    /// converts), u32 to f32 rounds to the nearest f32. To F16 and BF16 rounds to nearest even
    /// as torch's `.half()` and `.bfloat16()` do, bit for bit (past F16's range: inf; NaN
    /// stays NaN); from them is exact. The same dtype returns this tensor. A cast between
    /// float dtypes carries the grad back in the source's dtype; one to or from u32 records
    /// no grad (a u32 has none). A u32 made by a cast has no known index bound, so
    /// index ops refuse it (they check bounds without reading the device).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let op = match (self.dtype(), dtype) {
            (from, to) if from == to => return Ok(self.clone()),
            (DType::F32, DType::U32) => UnaryOp::F32ToU32,
            (DType::U32, DType::F32) => UnaryOp::U32ToF32,
            _ => return crate::ops::cast::cast("to_dtype", self, dtype),
        };
        unary(self, op, 0.0)
    }

    /// `self == s` elementwise, as a u32 mask of 0/1 (NaN equals nothing). This and the other
    /// `_scalar` comparisons also take U32 tensors of values below 2^24 (token ids), and a
    /// marker past them such as `IGNORE_INDEX`:
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let tokens = Tensor::from_vec_u32(vec![5, 9, 0, 0], &[1, 4], &dev)?; // 0 pads
    /// let attention_mask = tokens.ne_scalar(0.0)?; // as transformers' input_ids != pad
    /// assert_eq!(attention_mask.to_vec_u32()?, vec![1, 1, 0, 0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn eq_scalar(&self, s: f32) -> Result<Tensor> {
        compare_scalar(self, UnaryOp::EqScalar, s)
    }

    /// `self != s` elementwise, as a u32 mask of 0/1 (NaN differs from everything).
    pub fn ne_scalar(&self, s: f32) -> Result<Tensor> {
        compare_scalar(self, UnaryOp::NeScalar, s)
    }

    /// `self < s` elementwise, as a u32 mask of 0/1.
    pub fn lt_scalar(&self, s: f32) -> Result<Tensor> {
        compare_scalar(self, UnaryOp::LtScalar, s)
    }

    /// `self <= s` elementwise, as a u32 mask of 0/1.
    pub fn le_scalar(&self, s: f32) -> Result<Tensor> {
        compare_scalar(self, UnaryOp::LeScalar, s)
    }

    /// `self > s` elementwise, as a u32 mask of 0/1.
    pub fn gt_scalar(&self, s: f32) -> Result<Tensor> {
        compare_scalar(self, UnaryOp::GtScalar, s)
    }

    /// `self >= s` elementwise, as a u32 mask of 0/1.
    pub fn ge_scalar(&self, s: f32) -> Result<Tensor> {
        compare_scalar(self, UnaryOp::GeScalar, s)
    }
}

/// 1 where the u32 `mask` is 0, else 0.
pub(crate) fn mask_not(mask: &Tensor) -> Result<Tensor> {
    compare_scalar(mask, UnaryOp::MaskNot, 0.0)
}

/// A comparison with a scalar: a u32 mask (bound 2, so it may index) that records no grad.
/// U32 values (token ids: `tokens.ne_scalar(pad)` is an attention mask) compare as f32s, which
/// is exact while every value but a marker past them (an ignore_index) is below 2^24, as the
/// tensor's index range says; past that, or of unknown range, an error.
fn compare_scalar(x: &Tensor, op: UnaryOp, s: f32) -> Result<Tensor> {
    if x.dtype() == DType::U32 && op.dtypes().0 == DType::F32 {
        const EXACT: u32 = 1 << 24;
        return match x.index_range() {
            Some(range) if range.below <= EXACT => compare_scalar(&x.to_dtype(DType::F32)?, op, s),
            range => Err(Error::InvalidArgument {
                op: op.name(),
                msg: format!(
                    "compares u32 values as f32s, exact below 2^24, but the u32 tensor of shape \
                     {:?} holds values {}",
                    x.shape(),
                    match range {
                        Some(r) => format!("up to {}", r.below - 1),
                        None => "of unknown range".into(),
                    }
                ),
            }),
        };
    }
    Ok(unary(x, op, s)?.with_index_bound(Some(2)))
}
