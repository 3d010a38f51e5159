//! Checks over every WGSL module the crate can compile, whichever layer launches it.

use crate::kernel::COMMON_WGSL;

/// Every (key, WGSL source) the crate can compile.
fn all_kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    all.extend(crate::ops::copy::kernel_sources());
    all.extend(crate::ops::unary::kernel_sources());
    all.extend(crate::ops::binary::kernel_sources());
    all.extend(crate::ops::cast::kernel_sources());
    all.extend(crate::ops::matmul::kernel_sources());
    all.extend(crate::ops::reduce::kernel_sources());
    all.extend(crate::ops::softmax::kernel_sources());
    all.extend(crate::ops::index::kernel_sources());
    all.extend(crate::ops::conv::kernel_sources());
    all.extend(crate::ops::batch_norm::kernel_sources());
    all.extend(crate::ops::pool::kernel_sources());
    all.extend(crate::ops::rope::kernel_sources());
    all.extend(crate::ops::attention::kernel_sources());
    all.extend(crate::ops::norm::kernel_sources());
    all.extend(crate::ops::sort::kernel_sources());
    all.extend(crate::ops::scan::kernel_sources());
    all.extend(crate::autograd::kernel_sources());
    all.extend(crate::optim::kernel_sources());
    all.extend(crate::optim::scaler_kernel_sources());
    all
}

/// Kernels read their parameters only through `pu`/`pf`, whose opaque index keeps lavapipe
/// from inlining parameter values and recompiling the kernel per dispatch.
#[test]
fn kernels_read_params_only_through_pu() {
    for (key, source) in all_kernel_sources() {
        let family = source.strip_prefix(COMMON_WGSL).unwrap_or(&source);
        assert!(
            !family.contains("params."),
            "{key} reads the params uniform directly"
        );
    }
    let reads: Vec<&str> = COMMON_WGSL
        .lines()
        .filter(|l| l.contains("params.v"))
        .collect();
    assert_eq!(
        reads,
        [
            "    let opaque_zero = params.v[15].w;",
            "    return params.v[(i / 4u) | opaque_zero][i % 4u];"
        ]
    );
}

/// Kernels name their parameter slots (`pu(CAST_RANK)`), never a bare number, so the
/// layout lives only in the Rust params struct.
#[test]
fn kernels_name_their_param_slots() {
    let bare = regex_free_bare_slot;
    for (key, source) in all_kernel_sources() {
        let family = source.strip_prefix(COMMON_WGSL).unwrap_or(&source);
        if let Some(line) = family.lines().find(|l| bare(l)) {
            panic!("{key} reads a parameter slot by number: {line}");
        }
    }
}

/// True when `line` calls `pu(` or `pf(` with a digit as the first character of its argument.
fn regex_free_bare_slot(line: &str) -> bool {
    ["pu(", "pf("].iter().any(|call| {
        line.match_indices(call).any(|(at, _)| {
            let word_start = at == 0 || !line.as_bytes()[at - 1].is_ascii_alphanumeric();
            let arg = &line[at + call.len()..];
            word_start && arg.starts_with(|c: char| c.is_ascii_digit())
        })
    })
}

/// Every shader and every specialisation parses and validates, on any machine.
#[test]
fn every_kernel_source_validates_with_naga() {
    let sources = all_kernel_sources();
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

/// With `F16Reads::Native` and every binding F16, each module still parses and validates:
/// every operand section the device may swap for WGSL `f16` reads fits its module.
#[test]
fn every_kernel_source_validates_with_native_f16_operands() {
    use crate::device::pipelines::compiled_source;
    use crate::device::F16Reads;
    let mut rewritten = 0;
    for (key, source) in all_kernel_sources() {
        let native = compiled_source(&source, F16Reads::Native, u64::MAX);
        if !native.contains("array<vec4<f16>>") {
            continue;
        }
        rewritten += 1;
        let module = naga::front::wgsl::parse_str(&native)
            .unwrap_or_else(|e| panic!("{key}: {}", e.emit_to_string(&native)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::SUBGROUP
                | naga::valid::Capabilities::SHADER_FLOAT16
                | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32,
        )
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{key}: {}", e.emit_to_string(&native)));
    }
    // The elementwise families (unary, binary) and matmul, in their specialisations.
    assert!(rewritten >= 3, "{rewritten} modules had F16 operands");
}
