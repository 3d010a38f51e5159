//! Op families. Each file holds the forward of its ops (shape rules, output allocation, the
//! kernel launch) and, beside it, their backward rules; each family's WGSL is one file in
//! `shaders/`.

pub(crate) mod attention;
pub(crate) mod binary;
pub(crate) mod conv;
pub(crate) mod copy;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod pool;
pub(crate) mod reduce;
pub(crate) mod softmax;
pub(crate) mod unary;
pub(crate) mod view;
