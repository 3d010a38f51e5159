//! Elementwise binary ops with NumPy broadcasting, and the `std::ops` traits on `&Tensor`.
//! One WGSL template (`shaders/binary.wgsl`) is specialised with each op's expression.

use crate::device::Kernel;
use crate::error::{Error, Result};
use crate::ops::{dispatch, groups, module_source, CONTIGUOUS_PER_GROUP, WORKGROUP};
use crate::tensor::layout::{broadcast_shapes, merge_dims};
use crate::tensor::{DType, Tensor};

const BINARY_WGSL: &str = include_str!("../../shaders/binary.wgsl");

/// The binary ops; each is one specialisation of the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
}

impl BinaryOp {
    #[cfg(test)]
    const ALL: [BinaryOp; 5] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
    ];

    fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
        }
    }

    fn expr(self) -> &'static str {
        match self {
            BinaryOp::Add => "a + b",
            BinaryOp::Sub => "a - b",
            BinaryOp::Mul => "a * b",
            BinaryOp::Div => "a / b",
            BinaryOp::Maximum => "max(a, b)",
        }
    }

    fn source(self) -> String {
        module_source(BINARY_WGSL, &[("BINARY_EXPR", self.expr())])
    }
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    BinaryOp::ALL
        .iter()
        .map(|op| (format!("binary/{}", op.name()), op.source()))
        .collect()
}

/// `a op b` broadcast to their common shape, into a new contiguous tensor.
pub(crate) fn binary(a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    let name = op.name();
    a.expect_same_device(name, b)?;
    a.expect_dtype(name, DType::F32)?;
    b.expect_dtype(name, DType::F32)?;
    let shape = broadcast_shapes(a.shape(), b.shape()).ok_or_else(|| Error::Shape {
        op: name,
        msg: format!(
            "shapes {:?} and {:?} do not broadcast",
            a.shape(),
            b.shape()
        ),
    })?;
    let out = Tensor::empty(name, &shape, DType::F32, a.device())?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let la = a.layout().expand(name, &shape)?;
    let lb = b.layout().expand(name, &shape)?;
    let (rank, kshape, strides) =
        merge_dims(&shape, &[&la.strides, &lb.strides]).ok_or_else(|| Error::Shape {
            op: name,
            msg: format!("broadcast shape {shape:?} has more than 6 non-mergeable dims"),
        })?;
    let contiguous = la.is_contiguous() && lb.is_contiguous();
    // Four elements per load where lengths and offsets allow: about twice the bandwidth on
    // CPU adapters.
    let vec4 = contiguous
        && [n, la.offset, lb.offset]
            .iter()
            .all(|x| x.is_multiple_of(4));
    let (entry, per_group) = if contiguous {
        ("contiguous", CONTIGUOUS_PER_GROUP)
    } else {
        ("strided", WORKGROUP)
    };
    let mut params = vec![n as u32, la.offset as u32, lb.offset as u32, rank as u32];
    params.extend(&kshape);
    params.extend(&strides[0]);
    params.extend(&strides[1]);
    params.push(vec4 as u32);
    let key = format!("binary/{name}:{entry}");
    let kernel = Kernel {
        key: &key,
        entry,
        source: &|| op.source(),
    };
    dispatch(name, &kernel, &[a, b, &out], &params, groups(n, per_group))?;
    Ok(out)
}

impl Tensor {
    /// `self + other`, broadcast.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, BinaryOp::Add)
    }

    /// `self - other`, broadcast.
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, BinaryOp::Sub)
    }

    /// `self * other`, broadcast.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, BinaryOp::Mul)
    }

    /// `self / other`, broadcast.
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, BinaryOp::Div)
    }

    /// Elementwise maximum, broadcast.
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, BinaryOp::Maximum)
    }
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

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}
