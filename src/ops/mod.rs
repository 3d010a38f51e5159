//! Op families. Each file holds the forward of its ops (shape rules, output allocation,
//! dispatch) and, beside it, their backward rules; each family's WGSL is one file in `shaders/`.

pub(crate) mod binary;
pub(crate) mod copy;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod reduce;
pub(crate) mod softmax;
pub(crate) mod unary;
pub(crate) mod view;

use std::sync::Arc;

use crate::device::Kernel;
use crate::error::Result;
use crate::tensor::{Storage, Tensor};

/// Invocations per workgroup of the elementwise kernels.
pub(crate) const WORKGROUP: usize = 256;

/// Elements one workgroup of a contiguous elementwise kernel covers (`CONTIGUOUS_PER_GROUP`
/// in `shaders/common.wgsl`).
pub(crate) const CONTIGUOUS_PER_GROUP: usize = 16384;

/// Prepended to every family's WGSL.
const COMMON_WGSL: &str = include_str!("../../shaders/common.wgsl");

/// A family's WGSL with the common prelude and its placeholders replaced by a specialisation.
pub(crate) fn module_source(family_wgsl: &str, specialisation: &[(&str, &str)]) -> String {
    let mut source = format!("{COMMON_WGSL}\n{family_wgsl}");
    for (placeholder, value) in specialisation {
        source = source.replace(placeholder, value);
    }
    source
}

/// Workgroups needed to cover `n` items, `per_group` per workgroup.
pub(crate) fn groups(n: usize, per_group: usize) -> u32 {
    n.div_ceil(per_group) as u32
}

/// Records one dispatch binding `tensors`' buffers at bindings 1, 2, ... in order.
pub(crate) fn dispatch(
    op: &'static str,
    kernel: &Kernel,
    tensors: &[&Tensor],
    params: &[u32],
    workgroups: u32,
) -> Result<()> {
    let bound: Vec<(u32, &Tensor)> = (1..).zip(tensors.iter().copied()).collect();
    dispatch_at(op, kernel, &bound, params, workgroups)
}

/// Records one dispatch binding each tensor's buffer at the binding number beside it.
pub(crate) fn dispatch_at(
    op: &'static str,
    kernel: &Kernel,
    tensors: &[(u32, &Tensor)],
    params: &[u32],
    workgroups: u32,
) -> Result<()> {
    let storages: Vec<(u32, Arc<Storage>)> =
        tensors.iter().map(|(b, t)| (*b, t.storage())).collect();
    let buffers: Vec<(u32, &wgpu::Buffer)> =
        storages.iter().map(|(b, s)| (*b, s.buffer())).collect();
    tensors[0]
        .1
        .device()
        .inner
        .dispatch(op, kernel, &buffers, params, workgroups)
}

/// Every (key, WGSL source) the crate can compile, for the naga validation test.
#[cfg(test)]
pub(crate) fn all_kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    all.extend(copy::kernel_sources());
    all.extend(unary::kernel_sources());
    all.extend(binary::kernel_sources());
    all.extend(matmul::kernel_sources());
    all.extend(reduce::kernel_sources());
    all.extend(softmax::kernel_sources());
    all.extend(index::kernel_sources());
    all.extend(crate::autograd::kernel_sources());
    all.extend(crate::optim::kernel_sources());
    all
}

/// f32 bits for a parameter slot.
pub(crate) fn f32_bits(x: f32) -> u32 {
    x.to_bits()
}

#[cfg(test)]
mod tests {
    /// Kernels read their parameters only through `pu`/`pf`, whose opaque index keeps
    /// lavapipe from inlining parameter values and recompiling the kernel per dispatch.
    #[test]
    fn kernels_read_params_only_through_pu() {
        let common = super::COMMON_WGSL;
        for (key, source) in super::all_kernel_sources() {
            let family = source.strip_prefix(common).unwrap_or(&source);
            assert!(
                !family.contains("params."),
                "{key} reads the params uniform directly"
            );
        }
        let reads: Vec<&str> = common.lines().filter(|l| l.contains("params.v")).collect();
        assert_eq!(
            reads,
            [
                "    let opaque_zero = params.v[15].w;",
                "    return params.v[(i / 4u) | opaque_zero][i % 4u];"
            ]
        );
    }

    /// Every shader and every specialisation parses and validates, on any machine.
    #[test]
    fn every_kernel_source_validates_with_naga() {
        let sources = super::all_kernel_sources();
        assert!(
            sources.len() >= 20,
            "expected every family, got {}",
            sources.len()
        );
        for (key, source) in sources {
            let module = naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{key}: {}", e.emit_to_string(&source)));
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::SUBGROUP,
            )
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(naga::valid::SubgroupOperationSet::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{key}: {}", e.emit_to_string(&source)));
        }
    }
}
