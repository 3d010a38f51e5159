//! Launching a WGSL kernel: the one door from ops to the device.
//!
//! A kernel is an entry point of a [`ShaderFamily`] (one WGSL file under `shaders/`), possibly
//! specialised by replacing placeholders in its text. Its parameters are a typed struct
//! declared with [`kernel_params!`](crate::kernel_params), whose layout the family's WGSL sees
//! as named slot constants. A [`Launch`] binds tensors' buffers, uploads the params and records
//! one dispatch into the device's open batch.

mod params;

pub(crate) use crate::tensor::fusion::{Elementwise, EpilogueSite, Fusion, MergeSite};

pub(crate) use params::{KernelParams, ParamsLayout, MAX_SLOTS};

use std::borrow::Cow;
use std::sync::Arc;

use crate::device::{BufferSlice, Device, PipelineSource};
use crate::error::{Error, Result};
use crate::tensor::layout::merge_dims;
use crate::tensor::tape::{self, HostBytes};
use crate::tensor::{DType, Storage, Tensor};

/// Invocations per workgroup of the elementwise kernels.
pub(crate) const WORKGROUP: usize = 256;

/// Elements one workgroup of a contiguous elementwise kernel covers (`CONTIGUOUS_PER_GROUP`
/// in `shaders/common.wgsl`).
pub(crate) const CONTIGUOUS_PER_GROUP: usize = 16384;

/// The longest loop one invocation may run over data (a row, a span of k, a run of lookups).
/// llvmpipe ends an invocation's loops after 65,535 iterations, all loops counted, and
/// returns whatever was computed by then; a quarter of that leaves room for a kernel's few
/// passes and its other loops. Ops split longer work across invocations or launches.
pub(crate) const MAX_LOOP_LEN: usize = 16_384;

/// Prepended to every family's WGSL: the params uniform, `pu`/`pf`, index helpers.
pub(crate) const COMMON_WGSL: &str = include_str!("../../shaders/common.wgsl");

/// The one way kernels convert 16-bit elements: a prelude of the families that read them.
pub(crate) const SIXTEEN_BIT_WGSL: &str = include_str!("../../shaders/sixteen_bit.wgsl");

/// The stores of the elementwise families (unary, binary) into any dtype: a prelude of theirs.
pub(crate) const ELEMENTWISE_STORES_WGSL: &str =
    include_str!("../../shaders/elementwise_stores.wgsl");

/// The runs `(start, len)` of `n` elements (4 bytes each) that kernels process one window at
/// a time when a tensor is larger than one binding: each run's window fits a binding even
/// with a skip of less than one alignment at its front, and starts a multiple of 64 elements
/// from the tensor's first element (so windows of offset-0 tensors start aligned).
pub(crate) fn windows(device: &Device, n: usize) -> Vec<(usize, usize)> {
    let per = (rows_per_window(device, 1) / 64 * 64).max(64);
    (0..n).step_by(per).map(|s| (s, per.min(n - s))).collect()
}

/// How many rows of `row_len` elements (4 bytes each) one window holds
/// ([`DeviceInner::window_bytes`](crate::device::DeviceInner::window_bytes)): 0 when one row
/// is past a binding.
pub(crate) fn rows_per_window(device: &Device, row_len: usize) -> usize {
    (device.inner.window_bytes() / 4) as usize / row_len.max(1)
}

/// Workgroups needed to cover `n` items, `per_group` per workgroup.
pub(crate) fn groups(n: usize, per_group: usize) -> u32 {
    n.div_ceil(per_group) as u32
}

/// One WGSL file of kernels and the params structs its entry points read.
pub(crate) struct ShaderFamily {
    /// Names the family in pipeline keys and errors, e.g. `"unary"`.
    pub name: &'static str,
    /// The file's text (`include_str!`).
    pub wgsl: &'static str,
    /// The params layouts whose slot constants the file uses.
    pub params: &'static [&'static ParamsLayout],
    /// Shared WGSL the family's modules get after the common prelude, in order:
    /// [`SIXTEEN_BIT_WGSL`] where the file reads or writes 16-bit elements,
    /// [`ELEMENTWISE_STORES_WGSL`] for the elementwise families' stores.
    pub preludes: &'static [&'static str],
}

impl ShaderFamily {
    /// The module for one specialisation: the common prelude, the slot constants, and the
    /// family's text with each `(placeholder, value)` replaced.
    pub fn source(&self, specialisation: &[(&str, &str)]) -> String {
        self.source_of(self.wgsl, specialisation)
    }

    /// As [`ShaderFamily::source`] for an edited copy of the family's text (matmul's, with
    /// its stores chosen for the output dtype).
    pub fn source_of(&self, wgsl: &str, specialisation: &[(&str, &str)]) -> String {
        let slots: String = self.params.iter().map(|p| p.wgsl_slots()).collect();
        let preludes: String = self.preludes.concat();
        let mut source = format!("{COMMON_WGSL}\n{preludes}{slots}\n{wgsl}");
        for (placeholder, value) in specialisation {
            source = source.replace(placeholder, value);
        }
        source
    }
}

/// `wgsl` for a device with subgroups (`subgroups`) or without. Each SUBGROUP SECTION (the
/// text between a `// SUBGROUP SECTION BEGIN` and the `// SUBGROUP SECTION END` after it) is
/// kept only with subgroups: kernels that need the device's subgroup operations live there,
/// and a module that names them does not compile where the device has none. A section may
/// hold a `// SUBGROUP SECTION ELSE` line: the text after it is what a device without
/// subgroups gets instead (the same functions written without them), and only that device.
/// wgpu enables the subgroup built-ins with the device feature (its WGSL front end does not
/// take `enable subgroups;` yet).
pub(crate) fn with_subgroup_section(wgsl: &str, subgroups: bool) -> String {
    const BEGIN: &str = "// SUBGROUP SECTION BEGIN";
    const ELSE: &str = "// SUBGROUP SECTION ELSE";
    const END: &str = "// SUBGROUP SECTION END";
    let mut kept = String::with_capacity(wgsl.len());
    let mut rest = wgsl;
    while let Some(begin) = rest.find(BEGIN) {
        let Some(end) = rest[begin..].find(END).map(|at| begin + at) else {
            break;
        };
        let section = &rest[begin..end];
        let (with, without) = match section.find(ELSE) {
            Some(at) => section.split_at(at),
            None => (section, ""),
        };
        kept.push_str(&rest[..begin]);
        kept.push_str(if subgroups { with } else { without });
        rest = &rest[end + END.len()..];
    }
    kept.push_str(rest);
    kept
}

/// The WGSL of the lanes that run one row of a row kernel (`RowGroup`), prepended by the
/// families with `*_rows` entries (softmax, norm).
pub(crate) const ROW_GROUP_WGSL: &str = include_str!("../../shaders/row_group.wgsl");

/// The WGSL of an f32 sum or maximum over a workgroup, through subgroups or a tree, prepended
/// by the families that reduce in workgroups (softmax, batch_norm).
pub(crate) const WORKGROUP_REDUCE_WGSL: &str = include_str!("../../shaders/workgroup_reduce.wgsl");

/// Which lanes run one row of a row kernel's `*_rows` entries, and how they sum: what a
/// family splices for `ROW_GROUP` and `ROW_REDUCE` (see `shaders/row_group.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowLanes {
    /// A workgroup summing in a tree in workgroup memory: devices without subgroups of a
    /// fixed width.
    WorkgroupTree,
    /// A workgroup summing through subgroup operations first: long rows where the device has
    /// subgroups of a fixed width.
    WorkgroupSubgroups,
    /// A subgroup, with no workgroup memory and no barrier: short rows where the device has
    /// subgroups of a fixed width.
    Subgroup,
}

impl RowLanes {
    /// Every kind, for the shader checks.
    #[cfg(test)]
    pub const ALL: [RowLanes; 3] = [
        RowLanes::WorkgroupTree,
        RowLanes::WorkgroupSubgroups,
        RowLanes::Subgroup,
    ];

    /// The lanes a row gets on `device`: a subgroup where it is `short` (each family says
    /// what short is) and the device has subgroups of a fixed width, else a workgroup.
    pub fn of(device: &Device, short: bool) -> RowLanes {
        match (reduces_in_subgroups(device), short) {
            (false, _) => RowLanes::WorkgroupTree,
            (true, false) => RowLanes::WorkgroupSubgroups,
            (true, true) => RowLanes::Subgroup,
        }
    }

    /// Names the specialisation in pipeline keys.
    pub fn name(self) -> &'static str {
        match self {
            RowLanes::WorkgroupTree => "tree",
            RowLanes::WorkgroupSubgroups => "subgroups",
            RowLanes::Subgroup => "subgroup_rows",
        }
    }

    /// Workgroups of `workgroup` invocations that run `rows` rows: a row each, or, for
    /// subgroups, `workgroup / 8` rows each (the rows of 8-lane subgroups), which the
    /// workgroup's subgroups step through whatever their width (row_group.wgsl: a driver may
    /// pick the width per shader, so the adapter's figure cannot size the grid).
    pub fn workgroups(self, rows: usize, workgroup: usize) -> u32 {
        match self {
            RowLanes::Subgroup => groups(rows, workgroup / 8),
            _ => rows as u32,
        }
    }

    /// Whether the module keeps its SUBGROUP SECTIONs.
    pub fn subgroups(self) -> bool {
        self != RowLanes::WorkgroupTree
    }

    /// The family's `source` (with [`ROW_GROUP_WGSL`] among its preludes) specialised for
    /// these lanes: `ROW_GROUP` spliced with `workgroup_row` or `subgroup_row`, and
    /// `ROW_REDUCE` with the family's `row_reduce_tree`, `row_reduce_subgroups` or
    /// `row_reduce_in_subgroup`.
    pub fn source(self, source: &str) -> String {
        let (group, reduce) = match self {
            RowLanes::WorkgroupTree => ("workgroup_row", "row_reduce_tree"),
            RowLanes::WorkgroupSubgroups => ("workgroup_row", "row_reduce_subgroups"),
            RowLanes::Subgroup => ("subgroup_row", "row_reduce_in_subgroup"),
        };
        let source = source
            .replace("ROW_GROUP", group)
            .replace("ROW_REDUCE", reduce);
        with_subgroup_section(&source, self.subgroups())
    }
}

/// Whether kernels that sum over a workgroup or a row (reductions, softmax, cross-entropy,
/// the norms, BatchNorm) may use subgroup operations on `device`: where it has subgroups of a
/// fixed width, the width those kernels' host code plans with.
pub(crate) fn reduces_in_subgroups(device: &Device) -> bool {
    device.subgroup_size().is_some()
}

/// One kernel: an entry point of a family, in one specialisation.
pub(crate) struct Kernel<'a> {
    /// The family the entry point lives in.
    pub family: &'static ShaderFamily,
    /// The WGSL entry point.
    pub entry: &'static str,
    /// Names the specialisation in the pipeline key (`""` for an unspecialised family).
    pub variant: &'a str,
    /// Builds a specialised module source; called once, at the kernel's first launch.
    /// `None`: the family's text as it is.
    pub specialise: Option<&'a dyn Fn() -> String>,
    /// The function of the family's MEMBER SECTION the entry point runs, where a captured step
    /// may merge consecutive launches of this kernel into one (see [`Kernel::merging`]).
    pub part: Option<&'static str>,
    /// The bindings this specialisation reads or writes as 16-bit elements (through the
    /// conversions of `shaders/sixteen_bit.wgsl`), bit `b` for binding `b`; see
    /// [`Kernel::with_dtypes`].
    pub sixteen_bit: u64,
    /// The bindings of `sixteen_bit` that hold F16 (not BF16) elements: those a device with
    /// `F16Reads::Native` may bind as WGSL `f16`.
    pub f16_bindings: u64,
}

impl<'a> Kernel<'a> {
    /// An entry point of a family that has no placeholders.
    pub fn plain(family: &'static ShaderFamily, entry: &'static str) -> Kernel<'static> {
        Kernel {
            family,
            entry,
            variant: "",
            specialise: None,
            part: None,
            sixteen_bit: 0,
            f16_bindings: 0,
        }
    }

    /// An entry point in the specialisation `variant`, whose module `source` builds.
    pub fn specialised(
        family: &'static ShaderFamily,
        entry: &'static str,
        variant: &'a str,
        source: &'a dyn Fn() -> String,
    ) -> Kernel<'a> {
        Kernel {
            family,
            entry,
            variant,
            specialise: Some(source),
            part: None,
            sixteen_bit: 0,
            f16_bindings: 0,
        }
    }

    /// Declares the dtype each binding of this specialisation was built for; those of F16 or
    /// BF16 it reads or writes as 16-bit elements. A launch must bind 16-bit tensors at
    /// exactly these: any other kernel would read their words as f32 or u32 and answer
    /// wrong, and these would misread an F32 tensor.
    pub fn with_dtypes(mut self, bindings: &[(u32, DType)]) -> Self {
        let mask = |keep: fn(DType) -> bool| {
            (bindings.iter())
                .filter(|(_, dtype)| keep(*dtype))
                .fold(0, |mask, (binding, _)| mask | 1 << binding)
        };
        self.sixteen_bit = mask(DType::is_16_bit);
        self.f16_bindings = mask(|dtype| dtype == DType::F16);
        self
    }

    /// Marks the entry point as a call of `part(workgroup, lid)`, a function of the family's
    /// MEMBER SECTION: a captured step merges consecutive launches of the kernel over other
    /// buffers (each parameter's optimizer update) into one launch with a copy of the section
    /// per launch. The entry point must have workgroups of 256 invocations.
    pub fn merging(mut self, part: &'static str) -> Self {
        self.part = Some(part);
        self
    }

    /// The pipeline key `family/variant:entry`, and the length of its module part
    /// (`family/variant`), which names the module the family's entries share.
    fn key(&self) -> (String, usize) {
        let module_len = self.family.name.len() + 1 + self.variant.len();
        (
            format!("{}/{}:{}", self.family.name, self.variant, self.entry),
            module_len,
        )
    }

    /// The compiled pipeline of this kernel on `device`, compiling it at its first use.
    fn pipeline(&self, device: &Device) -> Arc<crate::device::CachedPipeline> {
        let (key, module_len) = self.key();
        let family = self.family;
        let plain_source = || family.source(&[]);
        let source = self.specialise.unwrap_or(&plain_source);
        device.inner.pipeline(&PipelineSource {
            key: &key,
            module_key: &key[..module_len],
            entry: self.entry,
            source,
            f16_bindings: self.f16_bindings,
        })
    }
}

/// One dispatch of a kernel, described then recorded with [`Launch::record`]: the kernel, the
/// tensors it binds, its params, and what a captured step may do with it.
///
/// ```ignore
/// Launch::new(op, &kernel, &[(1, &x), (2, &out)], &params).record(groups(n, 256))?;
/// ```
pub(crate) struct Launch<'a> {
    op: &'static str,
    kernel: &'a Kernel<'a>,
    bound: &'a [(u32, &'a Tensor)],
    /// Borrowed from the caller; owned when computed here (`new_dynamic`).
    params: Cow<'a, [u8]>,
    /// Recomputes the params before each replay of a captured step.
    dynamic_params: Option<HostBytes>,
    fusion: Option<Fusion<u32>>,
}

impl<'a> Launch<'a> {
    /// `kernel` binding `params` as the uniform at binding 0 and each tensor's buffer at the
    /// binding number beside it.
    pub fn new<P: KernelParams>(
        op: &'static str,
        kernel: &'a Kernel<'a>,
        bound: &'a [(u32, &'a Tensor)],
        params: &'a P,
    ) -> Launch<'a> {
        Launch {
            op,
            kernel,
            bound,
            params: Cow::Borrowed(bytemuck::bytes_of(params)),
            dynamic_params: None,
            fusion: None,
        }
    }

    /// For params that change from step to step (a learning rate, a step count): `params` is
    /// called now, and again before each replay of a captured step.
    pub fn new_dynamic<P: KernelParams>(
        op: &'static str,
        kernel: &'a Kernel<'a>,
        bound: &'a [(u32, &'a Tensor)],
        params: impl Fn() -> P + Send + Sync + 'static,
    ) -> Launch<'a> {
        let now = bytemuck::bytes_of(&params()).to_vec();
        // Kept for replays only while a step is captured.
        let dynamic_params = tape::is_open()
            .then(|| -> HostBytes { Arc::new(move || bytemuck::bytes_of(&params()).to_vec()) });
        Launch {
            op,
            kernel,
            bound,
            params: Cow::Owned(now),
            dynamic_params,
            fusion: None,
        }
    }

    /// What the capture fuser may do with the launch (an elementwise launch it may merge with
    /// its neighbours, a kernel whose `EPILOGUE SECTION` may run its consumers); `describe`
    /// runs only while a step is captured.
    pub fn fusible(mut self, describe: impl FnOnce() -> Fusion<u32>) -> Launch<'a> {
        self.fusion = tape::is_open().then(describe);
        self
    }

    /// Records the dispatch over `workgroups` workgroups (none: nothing is recorded).
    pub fn record(self, workgroups: u32) -> Result<()> {
        let Launch {
            op,
            kernel,
            bound,
            params,
            dynamic_params,
            fusion,
        } = self;
        // 16-bit tensors only where the kernel was specialised to read them as such.
        let misbound = bound
            .iter()
            .find(|(b, t)| t.dtype().is_16_bit() != (kernel.sixteen_bit >> b & 1 == 1));
        if let Some((_, t)) = misbound {
            return Err(Error::DType {
                op,
                msg: format!(
                    "{op} does not take {:?} tensors here (got one of shape {:?}): cast with to_dtype first",
                    t.dtype(),
                    t.shape()
                ),
            });
        }
        let storages: Vec<(u32, Arc<Storage>)> =
            bound.iter().map(|(b, t)| (*b, t.storage())).collect();
        let buffers: Vec<(u32, BufferSlice)> =
            storages.iter().map(|(b, s)| (*b, s.slice())).collect();
        let device = bound[0].1.device();
        let pipeline = kernel.pipeline(device);
        if workgroups > 0 && tape::is_open() {
            let fusion = fusion.or_else(|| {
                kernel.part.map(|part| {
                    Fusion::Merge(MergeSite {
                        part,
                        param_slots: params.len() / 4,
                    })
                })
            });
            tape::record_launch(
                op,
                &pipeline,
                bound,
                &params,
                dynamic_params,
                workgroups,
                fusion,
            );
        }
        device
            .inner
            .dispatch(op, &pipeline, &buffers, &params, workgroups)
    }
}

/// The dims a strided kernel walks: size-1 dims dropped, dense runs merged, padded at the
/// front to six (`strided_offset` in `shaders/common.wgsl`).
pub(crate) struct StridedDims {
    /// Dims left after merging (at most 6).
    pub rank: u32,
    /// Their sizes, padded with 1s at the front.
    pub shape: [u32; 6],
    /// Each operand's strides over those dims, padded with 0s at the front.
    pub strides: Vec<[u32; 6]>,
}

/// Merges `shape` for operands with `strides`, or an error naming `op` when more than six dims
/// remain.
pub(crate) fn strided_dims(
    op: &'static str,
    shape: &[usize],
    strides: &[&[usize]],
) -> Result<StridedDims> {
    let (rank, merged_shape, merged_strides) =
        merge_dims(shape, strides).ok_or_else(|| Error::Shape {
            op,
            msg: format!("shape {shape:?} has more than 6 non-mergeable dims"),
        })?;
    let six = |v: Vec<u32>| -> [u32; 6] { v.try_into().expect("merge_dims pads to six dims") };
    Ok(StridedDims {
        rank: rank as u32,
        shape: six(merged_shape),
        strides: merged_strides.into_iter().map(six).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::with_subgroup_section;

    const SECTIONS: &str =
        "a\n// SUBGROUP SECTION BEGIN\nwith\n// SUBGROUP SECTION ELSE\nwithout\n\
                            // SUBGROUP SECTION END\nb\n// SUBGROUP SECTION BEGIN\nonly\n\
                            // SUBGROUP SECTION END\nc";

    fn lines(wgsl: &str) -> Vec<&str> {
        wgsl.lines()
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
            .collect()
    }

    #[test]
    fn a_device_with_subgroups_keeps_each_section_up_to_its_else() {
        let kept = with_subgroup_section(SECTIONS, true);
        assert_eq!(lines(&kept), ["a", "with", "b", "only", "c"]);
    }

    #[test]
    fn a_device_without_subgroups_keeps_only_what_follows_an_else() {
        let kept = with_subgroup_section(SECTIONS, false);
        assert_eq!(lines(&kept), ["a", "without", "b", "c"]);
    }
}
